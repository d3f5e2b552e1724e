"""Memory-mapped day sources: TorchRec's NumPy layout and MLPerf's multi-hot layout.

Rows read back through the sources must equal, exactly, what the raw TSV reader gives for the same
rows and table sizes; takes may cross day boundaries and come in any order; every malformed
dataset must fail before training with a message naming the file at fault.
"""

from __future__ import annotations

import json
import pickle
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from app.data import preprocess
from app.data import multi_hot
from app.data.batches import make_batch
from app.data.multi_hot import MultiHotDaysSource, multi_hot_tables, write_multi_hot_day
from app.data.numpy_days import MAX_SLICE_RUNS, NumpyDaysSource
from app.data.synthetic import write_synthetic_criteo
from app.data.tsv import CriteoArrays, read_tsv

# Small and odd table sizes, so that the modulo matters for every feature.
SIZES = [3, 7, 10, 97, 100, 1_000, 4_096, 10_000, 65_537, 10**6] * 2 + [2, 5, 11, 13, 40_000_000, 2**31]
DAY_ROWS = (700, 1, 500)  # a one-row day in the middle: takes cross two boundaries at once


@pytest.fixture(scope="module")
def days(tmp_path_factory) -> tuple[Path, CriteoArrays]:
    """Three synthetic days preprocessed into a folder, and the same rows as the TSV reader gives them."""
    folder = tmp_path_factory.mktemp("numpy_days")
    files = []
    for day, rows in enumerate(DAY_ROWS):
        files.append(folder / f"raw_{day}.tsv")
        write_synthetic_criteo(files[-1], num_rows=rows, seed=300 + day)
    out = folder / "out"
    assert preprocess.main(["--input", json.dumps(list(map(str, files))), "--output", str(out), "--workers", "1", "--progress", "false"]) == 0
    expected = CriteoArrays.concat([read_tsv(path, SIZES) for path in files])
    return out, expected


def assert_same_batch(block, expected: CriteoArrays, rows: np.ndarray) -> None:
    """The batch from ``block`` equals the batch of the TSV reader's ``rows``, value for value."""
    got, want = make_batch(block, rows), make_batch(expected.take(rows), rows)
    assert torch.equal(got.dense_features, want.dense_features)
    assert torch.equal(got.labels, want.labels)
    assert torch.equal(got.sparse_features.values(), want.sparse_features.values())
    assert torch.equal(got.sparse_features.lengths(), want.sparse_features.lengths())


def test_every_row_equals_the_tsv_reader(days) -> None:
    out, expected = days
    source = NumpyDaysSource.from_directory(out, None, SIZES)
    assert len(source) == sum(DAY_ROWS) and not source.in_memory
    rows = np.arange(len(source))
    assert_same_batch(source.take(rows), expected, rows)


@pytest.mark.parametrize(
    "rows",
    [
        np.arange(690, 710),  # contiguous, across day 0 -> day 1 (one row) -> day 2
        np.array([700, 699, 701, 0, 1200, 5]),  # a few runs in any order
        np.random.default_rng(0).integers(0, sum(DAY_ROWS), 4 * MAX_SLICE_RUNS),  # scattered: per-day gathers
        np.array([3, 3, 3, 700, 700]),  # repeats
        np.empty(0, dtype=np.int64),
    ],
    ids=["contiguous", "few-runs", "scattered", "repeats", "empty"],
)
def test_takes_across_day_boundaries(days, rows: np.ndarray) -> None:
    out, expected = days
    source = NumpyDaysSource.from_directory(out, None, SIZES)
    assert_same_batch(source.take(rows), expected, rows)


def test_row_range_views(days) -> None:
    out, expected = days
    start, stop = 650, 1100  # ends in the middle of day 2
    ranged = NumpyDaysSource.from_directory(out, None, SIZES, start_row=start, stop_row=stop)
    assert len(ranged) == stop - start
    rows = np.arange(len(ranged))
    assert_same_batch(ranged.take(rows), expected, rows + start)
    # view() of a view, and a pickled view (DataLoader workers reopen the files)
    inner = pickle.loads(pickle.dumps(ranged.view(40, 60)))
    assert len(inner) == 20 and len(pickle.dumps(ranged)) < 2_000  # the mapped data is not pickled
    assert_same_batch(inner.take(np.arange(20)), expected, np.arange(20) + start + 40)
    with pytest.raises(IndexError, match="out of range"):
        ranged.take(np.array([stop - start]))
    with pytest.raises(ValueError, match="row range"):
        NumpyDaysSource.from_directory(out, None, SIZES, start_row=5, stop_row=sum(DAY_ROWS) + 1)


def test_chosen_days_and_prefixes(days) -> None:
    out, expected = days
    day_2 = NumpyDaysSource.from_directory(out, [2], SIZES)
    assert len(day_2) == DAY_ROWS[2]
    assert_same_batch(day_2.take(np.arange(3)), expected, np.arange(3) + DAY_ROWS[0] + DAY_ROWS[1])
    reordered = NumpyDaysSource([out / "day_2", out / "day_0"], SIZES)
    assert_same_batch(reordered.take(np.array([DAY_ROWS[2]])), expected, np.array([0]))


def write_day(folder: Path, day: int, rows: int = 4, **arrays: np.ndarray) -> None:
    """A valid NumPy day, with any of its arrays replaced."""
    folder.mkdir(parents=True, exist_ok=True)
    defaults = {
        "dense": np.zeros((rows, 13), np.float32),
        "sparse": np.arange(rows * 26, dtype=np.int64).reshape(rows, 26),
        "labels": np.zeros((rows, 1), np.int32),
    }
    for part, default in defaults.items():
        np.save(folder / f"day_{day}_{part}.npy", arrays.get(part, default))


def test_int32_ids_are_unsigned_and_negative_int64_ids_wrap(tmp_path) -> None:
    raw = np.array([[0, 1, 2**31 - 1, 2**31, 2**32 - 1] + [7] * 21], dtype=np.int64)
    write_day(tmp_path / "i32", 0, rows=1, sparse=raw.astype(np.uint32).view(np.int32), labels=np.zeros(1, np.int32))
    write_day(tmp_path / "i64", 0, rows=1, sparse=np.full((1, 26), -3, np.int64))
    sizes = [1000] * 26
    got = NumpyDaysSource.from_directory(tmp_path / "i32", None, sizes).take(np.array([0])).sparse
    np.testing.assert_array_equal(got, raw % 1000)  # as the TSV reader gives those 32-bit ids
    mixed = [2**32, 2**40, 3] + [2**31 + 1] * 23  # sizes above 2**32: the int64 path
    got = NumpyDaysSource.from_directory(tmp_path / "i32", None, mixed).take(np.array([0])).sparse
    np.testing.assert_array_equal(got, raw % np.array(mixed))
    negative = NumpyDaysSource.from_directory(tmp_path / "i64", None, sizes).take(np.array([0])).sparse
    np.testing.assert_array_equal(negative, np.full((1, 26), 997))  # floor modulo: a valid row


@pytest.mark.parametrize(
    "arrays, message",
    [
        ({"dense": np.zeros((4, 13), np.float64)}, r"day_0_dense\.npy: dtype float64, expected float32"),
        ({"sparse": np.zeros((4, 25), np.int64)}, r"day_0_sparse\.npy: shape \(4, 25\), expected \(rows, 26\)"),
        ({"sparse": np.zeros((4, 26), np.float32)}, r"day_0_sparse\.npy: dtype float32, expected int32 or int64"),
        (
            {"labels": np.zeros((4, 2), np.int32)},
            r"day_0_labels\.npy: shape \(4, 2\), expected \(rows,\) or \(rows, 1\)",
        ),
        ({"labels": np.zeros((4, 1), np.float32)}, r"day_0_labels\.npy: dtype float32, expected int32"),
        ({"labels": np.zeros((3, 1), np.int32)}, r"day_0_dense\.npy has 4 rows but .*day_0_labels\.npy has 3"),
    ],
    ids=["dense-dtype", "sparse-width", "sparse-dtype", "labels-shape", "labels-dtype", "row-counts"],
)
def test_bad_day_files_are_named(tmp_path, arrays, message) -> None:
    write_day(tmp_path, 0, **arrays)
    with pytest.raises(ValueError, match=message):
        NumpyDaysSource.from_directory(tmp_path, None, [10] * 26)


def test_missing_files_are_named(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="nowhere: data directory does not exist"):
        NumpyDaysSource.from_directory(tmp_path / "nowhere", None, [10] * 26)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"empty: no day_\*_dense\.npy files"):
        NumpyDaysSource.from_directory(tmp_path / "empty", None, [10] * 26)
    write_day(tmp_path / "data", 0)
    write_day(tmp_path / "data", 1)
    (tmp_path / "data" / "day_1_sparse.npy").unlink()
    with pytest.raises(FileNotFoundError, match=r"day_1_sparse\.npy: missing"):
        NumpyDaysSource.from_directory(tmp_path / "data", None, [10] * 26)
    with pytest.raises(FileNotFoundError, match=r"day_5_dense\.npy: missing \(day 5 was asked for"):
        NumpyDaysSource.from_directory(tmp_path / "data", [0, 5], [10] * 26)
    (tmp_path / "data" / "day_0_labels.npy").write_bytes(b"not numpy")
    with pytest.raises(ValueError, match=r"day_0_labels\.npy: not a readable \.npy file"):
        NumpyDaysSource.from_directory(tmp_path / "data", [0], [10] * 26)
    with pytest.raises(ValueError, match="26 positive table sizes"):
        NumpyDaysSource.from_directory(tmp_path / "data", [0], [10] * 25)


# ----------------------------------------------------------------------------------------------
# Multi-hot
# ----------------------------------------------------------------------------------------------

MH_SIZES = [50, 7, 3, 1000, 2**20 + 3] + [11] * 21  # table sizes E_j
MH_BAGS = list(multi_hot.MLPERF_MULTI_HOT_SIZES)  # m_j, 1 to 100 ids


@pytest.fixture(scope="module")
def multi_hot_day(tmp_path_factory) -> tuple[Path, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    folder = tmp_path_factory.mktemp("multi_hot")
    rng = np.random.default_rng(1)
    rows = 300
    one_hot = (
        rng.random((rows, 13), dtype=np.float32),
        rng.integers(0, 2**32, (rows, 26)).astype(np.uint32).view(np.int32),  # raw hashes as int32
        rng.integers(0, 2, (rows, 1)).astype(np.int32),
    )
    write_multi_hot_day(folder, 4, *one_hot, table_sizes=MH_SIZES, multi_hot_sizes=MH_BAGS)
    return folder, one_hot


def test_multi_hot_round_trip(multi_hot_day) -> None:
    folder, (dense, sparse, labels) = multi_hot_day
    source = MultiHotDaysSource.from_directory(folder, None, MH_SIZES)
    rows = np.arange(len(source))
    block = source.take(rows)
    assert len(source) == 300 and not source.in_memory
    np.testing.assert_array_equal(block.dense, dense)
    np.testing.assert_array_equal(block.labels, labels[:, 0])
    original = sparse.view(np.uint32).astype(np.int64) % np.array(MH_SIZES)
    for j, bag in enumerate(block.sparse):
        assert bag.shape == (300, MH_BAGS[j]) and bag.dtype == np.int64
        np.testing.assert_array_equal(bag[:, 0], original[:, j])  # column 0 is the original id
        assert 0 <= bag.min() and bag.max() < MH_SIZES[j]
    batch = make_batch(block, rows)
    lengths = batch.sparse_features.lengths().reshape(26, 300)
    assert (lengths == torch.tensor(MH_BAGS)[:, None]).all()
    assert batch.sparse_features.values().numel() == 300 * sum(MH_BAGS)


def test_multi_hot_matches_the_mlperf_construction(multi_hot_day) -> None:
    folder, (_, sparse, _) = multi_hot_day
    np.random.seed(0)  # the reference: one global seed, then the tables in order (dlrm multi_hot.py)
    expected_tables = [
        np.concatenate([np.arange(e)[:, None], np.random.randint(0, e, size=(e, m - 1))], axis=1)
        for e, m in zip(MH_SIZES, MH_BAGS)
    ]
    with np.load(folder / "day_4_sparse_multi_hot.npz") as archive:  # also: plain np.load reads our file
        for j, table in enumerate(expected_tables):
            ids = sparse[:, j].view(np.uint32).astype(np.int64) % MH_SIZES[j]
            np.testing.assert_array_equal(archive[str(j)], table[ids])
            assert archive[str(j)].dtype == np.int32


def test_converter_command_line(days, tmp_path, capsys) -> None:
    out, _ = days
    sizes, bags = [97] * 26, [2] * 25 + [5]
    argv = ["--input", str(out), "--output", str(tmp_path), "--days", "[0, 2]",
            "--num_embeddings_per_feature", json.dumps(list(sizes)), "--multi_hot_sizes", json.dumps(list(bags))]
    assert multi_hot.main(argv) == 0
    assert "day_2" in capsys.readouterr().out
    one_hot = NumpyDaysSource.from_directory(out, [0, 2], sizes)
    converted = MultiHotDaysSource.from_directory(tmp_path, None, sizes, multi_hot_sizes=bags)
    rows = np.arange(len(one_hot))
    want, got = one_hot.take(rows), converted.take(rows)
    np.testing.assert_array_equal(got.dense, want.dense)
    np.testing.assert_array_equal(got.labels, want.labels)
    for j in range(26):
        np.testing.assert_array_equal(got.sparse[j][:, 0], want.sparse[:, j])


def test_lookup_tables_drawn_in_blocks_equal_one_draw(monkeypatch) -> None:
    monkeypatch.setattr(multi_hot, "TABLE_ROWS_PER_STEP", 7)
    for distribution in ("uniform", "pareto"):
        tables = list(multi_hot_tables([50, 30], [4, 3], seed=0, distribution=distribution))
        rng = np.random.RandomState(0)
        for table, (e, m) in zip(tables, [(50, 4), (30, 3)]):
            if distribution == "uniform":
                expected = rng.randint(0, e, size=(e, m - 1))
            else:
                with np.errstate(invalid="ignore"):
                    expected = rng.pareto(a=0.25, size=(e, m - 1)).astype(np.int32) % e
            np.testing.assert_array_equal(table[:, 1:], expected)
            np.testing.assert_array_equal(table[:, 0], np.arange(e))


def test_multi_hot_reads_np_savez_files_and_views(tmp_path) -> None:
    rows = 9
    bags = {str(j): np.arange(rows * (j % 3 + 1), dtype=np.int32).reshape(rows, -1) + j for j in range(26)}
    np.savez(tmp_path / "day_0_sparse_multi_hot.npz", **bags)
    np.save(tmp_path / "day_0_dense.npy", np.ones((rows, 13), np.float32))
    np.save(tmp_path / "day_0_labels.npy", np.ones(rows, np.int32))
    source = MultiHotDaysSource.from_directory(tmp_path, None, [10**6] * 26)
    view = pickle.loads(pickle.dumps(source.view(3, 7)))
    block = view.take(np.array([0, 3]))
    for j in range(26):
        np.testing.assert_array_equal(block.sparse[j], bags[str(j)][[3, 6]])


def _multi_hot_files(folder: Path, rows: int = 5, save=np.savez, **replace: np.ndarray) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    bags = {str(j): np.zeros((rows, 2), np.int32) for j in range(26)}
    bags.update({k: v for k, v in replace.items() if k.isdigit()})
    for key in replace.get("drop", ()):
        bags.pop(key)
    save(folder / "day_0_sparse_multi_hot.npz", **bags)
    np.save(folder / "day_0_dense.npy", replace.get("dense", np.zeros((rows, 13), np.float32)))
    np.save(folder / "day_0_labels.npy", np.zeros((rows, 1), np.int32))


def test_multi_hot_bad_files_are_named(tmp_path) -> None:
    def load(name: str, **kwargs):
        return MultiHotDaysSource.from_directory(tmp_path / name, None, [10] * 26, **kwargs)

    _multi_hot_files(tmp_path / "compressed", save=np.savez_compressed)
    compressed = r"day_0_sparse_multi_hot\.npz: member '0' is compressed.*np\.savez \(not np\.savez_compressed\)"
    with pytest.raises(ValueError, match=compressed):
        load("compressed")
    _multi_hot_files(tmp_path / "no_key", drop=("17",))
    with pytest.raises(ValueError, match=r"day_0_sparse_multi_hot\.npz: no array '17'"):
        load("no_key")
    _multi_hot_files(tmp_path / "short", **{"5": np.zeros((4, 2), np.int32)})
    with pytest.raises(ValueError, match=r"day_0_dense\.npy has 5 rows but .*day_0_sparse_multi_hot\.npz\['5'\] has 4"):
        load("short")
    _multi_hot_files(tmp_path / "float", **{"3": np.zeros((5, 2), np.float32)})
    with pytest.raises(ValueError, match=r"\['3'\]: dtype float32, expected int32 or int64"):
        load("float")
    _multi_hot_files(tmp_path / "width")
    with pytest.raises(ValueError, match=r"\['0'\]: shape \(5, 2\), expected \(rows, 3\)"):
        load("width", multi_hot_sizes=MH_BAGS)
    _multi_hot_files(tmp_path / "dense", dense=np.zeros((5, 12), np.float32))
    with pytest.raises(ValueError, match=r"day_0_dense\.npy: shape \(5, 12\), expected \(rows, 13\)"):
        load("dense")
    _multi_hot_files(tmp_path / "labels_missing")
    (tmp_path / "labels_missing" / "day_0_labels.npy").unlink()
    with pytest.raises(FileNotFoundError, match=r"day_0_labels\.npy: missing"):
        load("labels_missing")
    (tmp_path / "not_zip").mkdir()
    (tmp_path / "not_zip" / "day_0_sparse_multi_hot.npz").write_bytes(b"nope")
    _multi_hot_files(tmp_path / "not_zip_dense")  # dense and labels from elsewhere, then a broken npz
    for part in ("dense", "labels"):
        name = f"day_0_{part}.npy"
        (tmp_path / "not_zip" / name).write_bytes((tmp_path / "not_zip_dense" / name).read_bytes())
    with pytest.raises(ValueError, match=r"day_0_sparse_multi_hot\.npz: not a readable \.npz"):
        load("not_zip")


def test_extra_npz_members_are_ignored(tmp_path) -> None:
    _multi_hot_files(tmp_path)
    path = tmp_path / "day_0_sparse_multi_hot.npz"
    with zipfile.ZipFile(path, "a", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("notes.txt", b"x" * 1000)  # deflated, but not one of the keys read
    source = MultiHotDaysSource.from_directory(tmp_path, None, [10] * 26)
    assert len(source.take(np.arange(5)).sparse) == 26
