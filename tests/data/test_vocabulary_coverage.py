"""The ids outside data.frequency_threshold's vocabulary: counted exactly where they are mapped (in
memory, and while cached days are mapped, per row range, kept in the mapped folder's metadata.json for
any split's rows, also after an interrupted mapping), the report and its warning, the setting, the
default warn share measured on real rows (held-out rows of the same data against rows of another
source), the data module's report of a named split's rows (none for hashed ids), and `python -m app`
on 2 processes: fit, validate and predict report exact shares, and warn on rows of another source
only."""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import get_args

import numpy as np
import pytest

from app.criteo import NUM_SPARSE, SPARSE_NAMES
from app.data.cache import CACHE_FILE, CacheRequest, read_metadata
from app.data.datamodule import CriteoDataModule
from app.data.frequency_threshold import mapped_days, training_vocabulary
from app.data.preprocess import RAW_IDS, Vocabulary
from app.data.preprocess.vocabulary import MAP_BLOCK_ROWS, vocabulary_sha256
from app.data.splits import RowPart, part_rows
from app.data.synthetic import write_synthetic_criteo
from app.data.tsv import read_tsv
from app.data.vocabulary_coverage import (
    DEFAULT_WARN_SHARE,
    METADATA_KEY,
    OutsideCounts,
    check_warn_share,
    count_mapped,
    from_metadata,
    report,
)
from tests.checkpoint.test_checkpoint_runs import REPO, app_env

THRESHOLD = 3


def kept_ids(raw_train: np.ndarray, threshold: int = THRESHOLD) -> list[np.ndarray]:
    """Per feature, the raw ids seen >= threshold times (np.unique: independent of the app's counting)."""
    kept = []
    for j in range(NUM_SPARSE):
        ids, counts = np.unique(raw_train[:, j], return_counts=True)
        kept.append(ids[counts >= threshold].astype(np.int64))
    return kept


def outside(kept: list[np.ndarray], raw: np.ndarray) -> list[int]:
    """Per feature, the ids of ``raw`` not in ``kept`` (np.isin: not the app's binary search)."""
    return [int(np.count_nonzero(~np.isin(raw[:, j], kept[j]))) for j in range(NUM_SPARSE)]


def in_memory(kept: list[np.ndarray]) -> Vocabulary:
    return Vocabulary(THRESHOLD, kept, vocabulary_sha256(kept))


def test_map_counts_the_ids_it_maps_to_one_exactly_across_blocks():
    rng = np.random.default_rng(0)
    rows = 2 * MAP_BLOCK_ROWS + 123  # three blocks of the mapping: the counts add up across them
    raw = rng.integers(0, 50, (rows, NUM_SPARSE)) * rng.integers(1, 3, NUM_SPARSE)  # some features sparser
    kept = [np.sort(rng.choice(100, size=int(rng.integers(1, 60)), replace=False)).astype(np.int64) for _ in range(NUM_SPARSE)]
    kept[5] = np.empty(0, dtype=np.int64)  # a feature with an empty vocabulary: every id outside
    counts = np.zeros(NUM_SPARSE, dtype=np.int64)
    mapped = in_memory(kept).map(raw.copy(), outside_counts=counts)
    assert counts.tolist() == outside(kept, raw)
    assert counts[5] == rows and (counts > 0).all()
    assert count_mapped(mapped).tolist() == counts.tolist()  # the same, read from the mapped ids
    again = counts.copy()
    in_memory(kept).map(raw, out=raw, outside_counts=again)  # in place; counts accumulate
    assert again.tolist() == (2 * counts).tolist()


def write_days(folder: Path, rows: int, seed: int, id_hash: int = 0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    write_synthetic_criteo(folder / f"rows_{seed}_{id_hash}.tsv", num_rows=rows, seed=seed, id_hash=id_hash)
    return folder / f"rows_{seed}_{id_hash}.tsv"


def request(tmp_path: Path, *files: Path) -> CacheRequest:
    return CacheRequest(tuple(files), "log1p", "error", tmp_path / "cache", workers=1)


def test_the_mapped_cache_keeps_exact_counts_for_every_split_and_a_later_run_reads_them(tmp_path):
    train = write_days(tmp_path, 600, seed=1)
    # Two files (two cached days) of 111 and 96 rows, one of another source: every standard split's
    # rows (Kaggle's 7 days, the halves) cut the days somewhere else.
    scored = [write_days(tmp_path, 111, seed=2), write_days(tmp_path, 96, seed=3, id_hash=1)]
    vocabulary = training_vocabulary(request(tmp_path, train), "all", THRESHOLD, "data.train")
    folder = mapped_days(request(tmp_path, *scored), vocabulary)
    raw = np.concatenate([read_tsv(path, RAW_IDS).sparse for path in scored])
    kept = kept_ids(read_tsv(train, RAW_IDS).sparse)
    assert [np.asarray(ids).tolist() for ids in vocabulary.ids] == [ids.tolist() for ids in kept]
    metadata = read_metadata(folder)
    for part in get_args(RowPart):
        start, stop = part_rows(part, len(raw))
        assert from_metadata(metadata, start, stop) == OutsideCounts.of(stop - start, outside(kept, raw[start:stop])), part
    assert metadata[METADATA_KEY]["rows"] == len(raw) and metadata[METADATA_KEY]["ids_per_feature"] == outside(kept, raw)
    # A later run reuses the folder: its counts come from metadata.json, no id is read or mapped again
    # (the raw days it was mapped from are gone; a rank that does not convert would stop on them).
    shutil.rmtree(request(tmp_path, *scored).folder)
    again = mapped_days(request(tmp_path, *scored), vocabulary, convert=False)
    assert again == folder and read_metadata(again) == metadata


def test_an_interrupted_mapping_counts_the_days_it_had_finished_from_their_mapped_ids(tmp_path):
    train = write_days(tmp_path, 600, seed=1)
    scored = request(tmp_path, write_days(tmp_path, 90, seed=2), write_days(tmp_path, 70, seed=3, id_hash=1))
    vocabulary = training_vocabulary(request(tmp_path, train), "all", THRESHOLD, "data.train")
    folder = mapped_days(scored, vocabulary)
    complete = read_metadata(folder)
    # As a killed mapping leaves it: day 1 mapped, day 0 not, no metadata.json, the folder incomplete.
    state = json.loads((folder / CACHE_FILE).read_text())
    (folder / CACHE_FILE).write_text(json.dumps(dict(state, complete=False)))
    (folder / "metadata.json").unlink()
    (folder / "day_0_sparse.npy").unlink()
    assert mapped_days(scored, vocabulary) == folder
    assert read_metadata(folder) == complete


def report_of(counts: OutsideCounts, warn_share: float, caplog) -> tuple[str, list[str]]:
    """The info line and the warnings ``report`` gives."""
    caplog.clear()
    with caplog.at_level(logging.INFO), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report("data.val", counts, THRESHOLD, warn_share)
    return caplog.text, [str(warning.message) for warning in caught]


def test_the_report_gives_every_features_share_and_warns_naming_those_above_the_setting(caplog):
    ids = [0] * NUM_SPARSE
    ids[2], ids[3], ids[20] = 400, 361, 360  # of 400 rows: 100 %, 90.25 %, exactly 90 %
    info, warned = report_of(OutsideCounts.of(400, ids), 0.9, caplog)
    per_feature = ", ".join(f"{name} {count / 400:.2%}" for name, count in zip(SPARSE_NAMES, ids))
    assert (f"data.val: 400 rows, {sum(ids) / (400 * 26):.2%} of their ids outside the vocabulary of "
            f"data.frequency_threshold = 3 (mapped to the shared id 1); per feature: {per_feature}") in info
    assert len(warned) == 1  # only shares above the setting: C21's 90 % is not
    assert warned[0].startswith("data.val: 2 of 26 features have a share of ids outside the vocabulary above "
                                "data.out_of_vocabulary_warn_share = 0.9: C3 100.00%, C4 90.25%. ")
    assert report_of(OutsideCounts.of(400, ids), 1.0, caplog)[1] == []  # 1: never warns


def test_the_warn_share_is_a_share():
    assert check_warn_share(0.0) == 0.0 and check_warn_share(1.0) == 1.0
    for refused in (-0.1, 1.5):
        with pytest.raises(ValueError, match=rf"^data\.out_of_vocabulary_warn_share = {refused} must be within 0 \.\. 1 "):
            check_warn_share(refused)


def test_the_default_warn_share_passes_held_out_rows_and_warns_on_another_source(shared_criteo):
    # The measurement beside DEFAULT_WARN_SHARE: a vocabulary (T = 3) of half the Kaggle rows.
    kaggle = read_tsv(shared_criteo / "kaggle_train_4571.tsv", RAW_IDS).sparse
    terabyte = read_tsv(shared_criteo / "terabyte_day0_10k.tsv", RAW_IDS).sparse
    half = len(kaggle) // 2
    vocabulary = in_memory(kept_ids(kaggle[:half]))

    def shares(raw: np.ndarray) -> np.ndarray:
        counts = np.zeros(NUM_SPARSE, dtype=np.int64)
        vocabulary.map(raw, outside_counts=counts)
        return counts / len(raw)

    held_out, other = shares(kaggle[half:]), shares(terabyte)
    assert held_out.max() == pytest.approx(0.772, abs=5e-4)  # C3: rare ids dominate a sample this small
    assert held_out.max() < DEFAULT_WARN_SHARE
    assert np.count_nonzero(other > DEFAULT_WARN_SHARE) == 25 and other.mean() == pytest.approx(0.979, abs=5e-4)


def test_a_data_module_reports_the_rows_of_its_split_and_nothing_for_hashed_ids(tmp_path, caplog):
    # Kaggle's split of one file: validate and test report their own halves of day 6 (not the file's rows).
    root = write_days(tmp_path, 700, seed=4)
    raw = read_tsv(root, RAW_IDS).sparse
    settings = dict(split="kaggle", root=str(root), cache_dir=str(tmp_path / "cache"), cache_workers=1,
                    num_embeddings_per_feature="auto")  # fmt: skip
    kept = kept_ids(raw[slice(*part_rows("kaggle_train", len(raw)))])
    with caplog.at_level(logging.INFO):
        data = CriteoDataModule(frequency_threshold=THRESHOLD, **settings)
        for stage, part in (("validate", "kaggle_val"), ("test", "kaggle_test")):
            caplog.clear()
            data.setup(stage)
            start, stop = part_rows(part, len(raw))
            assert report_line(caplog.text, f"data.root ({part} rows)") == expected_line(kept, raw[start:stop])
        caplog.clear()
        CriteoDataModule(frequency_threshold=0, **settings).setup("validate")
        assert "outside the vocabulary" not in caplog.text  # hashed ids: which ones training saw is not kept


def report_line(output: str, where: str) -> str:
    """What the report printed for ``where``: rows, overall share, and each feature's share."""
    found = re.findall(rf"{re.escape(where)}: (.*? outside the vocabulary of .*)$", output, flags=re.MULTILINE)
    assert len(set(found)) == 1, (where, output[-3000:])
    return found[0]


def expected_line(kept: list[np.ndarray], raw: np.ndarray) -> str:
    """The report's line for rows ``raw``, from the exact counts of ids outside ``kept``."""
    counts, rows = outside(kept, raw), len(raw)
    per_feature = ", ".join(f"{name} {count / rows:.2%}" for name, count in zip(SPARSE_NAMES, counts))
    return (f"{rows:,} rows, {sum(counts) / (rows * NUM_SPARSE):.2%} of their ids outside the vocabulary of "
            f"data.frequency_threshold = {THRESHOLD} (mapped to the shared id 1); per feature: {per_feature}")


# ---- as a user runs it: python -m app on 2 processes (gloo) ----------------------------------------


def app_run(*args: str) -> str:
    """``python -m app ARGS`` (Lightning starts the second rank); its output, stdout and stderr."""
    done = subprocess.run([sys.executable, "-m", "app", *args], capture_output=True, text=True, timeout=300,
                          env=app_env(), cwd=REPO)  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-5000:]
    return output


def test_scoring_rows_of_another_source_reports_their_shares_and_warns(sample, tmp_path):
    other = {"val": tmp_path / "other_val.tsv", "predict": tmp_path / "other_predict.tsv"}
    write_synthetic_criteo(other["val"], num_rows=300, seed=13, id_hash=1)  # the same rows' kind, other id hashes
    write_synthetic_criteo(other["predict"], num_rows=200, seed=14, labelled=False, id_hash=1)
    settings = [
        "--config", "configs/demo.yaml", "--data.train", str(sample["train"]), "--data.test", "null",
        "--data.frequency_threshold", str(THRESHOLD), "--data.num_embeddings_per_feature", "auto",
        "--data.cache_dir", str(tmp_path / "cache"), "--data.cache_workers", "1", "--data.batch_size", "64",
        "--model.embedding_dim", "8", "--model.dense_arch_layer_sizes", "[16, 8]",
        "--model.over_arch_layer_sizes", "[16, 1]",
        "--trainer.logger", "false", "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(tmp_path / "run"),
    ]  # fmt: skip
    kept = kept_ids(read_tsv(sample["train"], RAW_IDS).sparse)
    checkpoint = ["--ckpt_path", str(tmp_path / "run" / "checkpoints" / "last.ckpt")]

    # Validation rows of the training data: reported, no warning.
    fitted = app_run("fit", *settings, "--data.val", str(sample["val"]), "--data.predict", "null")
    assert report_line(fitted, "data.val") == expected_line(kept, read_tsv(sample["val"], RAW_IDS).sparse)
    assert "data.out_of_vocabulary_warn_share" not in fitted

    # Rows of another source, validated and scored with the checkpoint: reported, and warned.
    validated = app_run("validate", *settings, *checkpoint, "--data.val", str(other["val"]), "--data.predict", "null")
    predicted = app_run("predict", *settings, *checkpoint, "--data.val", "null", "--data.predict", str(other["predict"]))
    for output, split in ((validated, "val"), (predicted, "predict")):
        raw = read_tsv(other[split], RAW_IDS).sparse
        assert report_line(output, f"data.{split}") == expected_line(kept, raw)
        shares = np.asarray(outside(kept, raw)) / len(raw)
        above = ", ".join(f"{name} {share:.2%}" for name, share in zip(SPARSE_NAMES, shares) if share > DEFAULT_WARN_SHARE)
        warning = (f"UserWarning: data.{split}: {np.count_nonzero(shares > DEFAULT_WARN_SHARE)} of 26 features have a "
                   f"share of ids outside the vocabulary above data.out_of_vocabulary_warn_share = 0.9: {above}. ")
        assert warning in output and output.count(warning) == 1  # global rank 0 only
    # The validated rows' counts, exact, in their mapped cache for a later run.
    (mapped,) = (tmp_path / "cache").glob("other_val-*-ids-*")
    raw = read_tsv(other["val"], RAW_IDS).sparse
    assert read_metadata(mapped)[METADATA_KEY]["ids_per_feature"] == outside(kept, raw)
