"""Standard splits by name, and choosing the format from what a folder holds."""

from __future__ import annotations

import numpy as np
import pytest

from app.data.datamodule import CriteoDataModule
from app.data.formats import detect_format
from app.data.splits import day_bounds, halves
from app.data.synthetic import write_synthetic_criteo
from app.data.tsv import read_tsv

SIZES = [1000] * 26


def named_split(name: str, root: str, tmp_path, stage: str = "fit") -> dict:
    """The sources of a standard split, as the data module reads them for ``stage`` and test."""
    data = CriteoDataModule(split=name, root=root, num_embeddings_per_feature=SIZES, shuffle=False,
                            cache_dir=str(tmp_path / "cache"), cache_workers=1)  # fmt: skip
    data.setup(stage)
    data.setup("test")
    return {split: batches.source for split, batches in data.datasets.items()}


def test_day_bounds_and_halves():
    assert day_bounds(23, 7) == [(0, 4), (4, 8), (8, 11), (11, 14), (14, 17), (17, 20), (20, 23)]
    assert halves(20, 23) == ((20, 22), (22, 23))  # numpy.array_split puts the odd row first
    assert halves(0, 4) == ((0, 2), (2, 4))


def test_kaggle_split_cuts_train_txt_into_seven_days(tmp_path):
    path = tmp_path / "train.txt"
    write_synthetic_criteo(path, num_rows=703, seed=5)
    everything = read_tsv(path, SIZES)
    split = named_split("kaggle", str(path), tmp_path)
    # 703 = 7 x 100 + 3: days 0-2 have 101 rows, so day 6 is rows 603-702; test its first 50, val the rest.
    assert [len(split[k]) for k in ("train", "test", "val")] == [603, 50, 50]
    for name, start in (("train", 0), ("test", 603), ("val", 653)):
        block = split[name].take(np.arange(len(split[name])))
        np.testing.assert_array_equal(block.sparse, everything.sparse[start : start + len(split[name])])


def test_terabyte_split_uses_days_0_to_22_and_halves_day_23(tmp_path):
    for day in range(24):
        write_synthetic_criteo(tmp_path / f"day_{day}", num_rows=10 + day, seed=day)
    split = named_split("terabyte", str(tmp_path), tmp_path)
    assert len(split["train"]) == sum(10 + d for d in range(23))
    assert (len(split["val"]), len(split["test"])) == (17, 16)  # day 23 has 33 rows
    day_23 = read_tsv(tmp_path / "day_23", SIZES)
    np.testing.assert_array_equal(split["test"].take(np.arange(16)).dense, day_23.dense[17:])


def test_terabyte_split_names_a_missing_day(tmp_path):
    for day in range(23):
        write_synthetic_criteo(tmp_path / f"day_{day}", num_rows=5, seed=day)
    with pytest.raises(FileNotFoundError, match="day_23 .or .gz. does not exist"):
        named_split("terabyte", str(tmp_path), tmp_path)


def test_format_is_detected_from_the_folder(tmp_path):
    assert detect_format(tmp_path) == "tsv"
    (tmp_path / "day_0_dense.npy").touch()
    assert detect_format(tmp_path) == "numpy"
    (tmp_path / "day_0_sparse_multi_hot.npz").touch()
    assert detect_format(tmp_path) == "multi_hot"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"split": "kaggle"}, "data.split = kaggle needs data.root"),
        ({"split": "kaggle", "root": "x", "train": "y"}, "data.split replaces data.train/val/test"),
        ({"split": "terabyte", "root": "no/such/folder"}, "data.root: no/such/folder does not exist"),
    ],
)
def test_bad_data_settings_are_named_before_training(kwargs, message):
    with pytest.raises((ValueError, FileNotFoundError)) as error:
        CriteoDataModule(num_embeddings_per_feature=1000, **kwargs)
    assert message in str(error.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"train": "no/such/*.tsv"}, "data.train: no data files match the pattern 'no/such/*.tsv'"),
        ({"train": "no/such/dir", "format": "numpy"}, "data.train: no/such/dir: data directory does not exist"),
    ],
)
def test_missing_files_are_named_by_the_stage_that_reads_them(kwargs, message):
    data = CriteoDataModule(num_embeddings_per_feature=1000, **kwargs)  # fine until a stage reads them
    with pytest.raises((ValueError, FileNotFoundError)) as error:
        data.setup("fit")
    assert message in str(error.value)
