"""The synthetic Criteo-format generator: deterministic, realistic-looking, with a planted signal,
and readable by the strict TSV reader."""

from __future__ import annotations

import importlib.util
import itertools
import re
from pathlib import Path

import numpy as np
import pytest

from app.data import synthetic
from app.data.synthetic import rank_auc, sample_rows, true_click_probability, write_synthetic_criteo
from app.data.tsv import read_tsv

ROWS = 20_000
RAW = [2**32] * 26


@pytest.fixture(scope="module")
def sample(tmp_path_factory) -> tuple[Path, synthetic.SyntheticSummary]:
    path = tmp_path_factory.mktemp("synthetic") / "train.tsv"
    return path, write_synthetic_criteo(path, ROWS, seed=1)


def test_same_seed_same_bytes(sample, tmp_path):
    path, summary = sample
    again = write_synthetic_criteo(tmp_path / "again.tsv", ROWS, seed=1)
    assert (tmp_path / "again.tsv").read_bytes() == path.read_bytes()
    assert again == summary


def test_other_seed_other_rows_same_world(sample, tmp_path):
    path, _ = sample
    write_synthetic_criteo(tmp_path / "other.tsv", ROWS, seed=2)
    assert (tmp_path / "other.tsv").read_bytes() != path.read_bytes()
    # Same world: the ids (hashes) of a feature come from the same vocabulary in both files, so
    # nearly every row of one file has ids seen in the other (with other hashes: almost none).
    first, other = (read_tsv(p, RAW).sparse for p in (path, tmp_path / "other.tsv"))
    for j in range(26):
        assert np.isin(other[:, j], first[:, j]).mean() > 0.9, f"C{j + 1}"


def test_click_rate_and_bayes_auc(sample):
    _, summary = sample
    assert summary.num_rows == ROWS
    assert summary.positive_rate == pytest.approx(0.25, abs=0.02)
    assert 0.75 <= summary.bayes_auc <= 0.85


def test_bayes_auc_holds_on_another_seed():
    rows = sample_rows(ROWS, seed=7)
    assert rows.labels.mean() == pytest.approx(0.25, abs=0.02)
    assert 0.75 <= rank_auc(rows.true_logits, rows.labels) <= 0.85
    # The click probability ranks rows exactly as the logits do, and is calibrated on average.
    probability = true_click_probability(rows.ids, rows.dense, rows.dense_missing)
    assert rank_auc(probability, rows.labels) == rank_auc(rows.true_logits, rows.labels)
    assert probability.mean() == pytest.approx(rows.labels.mean(), abs=0.02)


def test_parses_cleanly_with_the_strict_reader(sample):
    path, summary = sample
    arrays = read_tsv(path, [10_000] * 26)
    assert len(arrays) == ROWS
    assert int(arrays.labels.sum()) == summary.positives
    assert set(np.unique(arrays.labels)) == {0.0, 1.0}
    assert (arrays.sparse >= 0).all() and (arrays.sparse < 10_000).all()


def test_looks_like_criteo(sample):
    path, _ = sample
    lines = path.read_text("ascii").split("\n")
    assert lines.pop() == ""  # newline-terminated
    rows = [line.split("\t") for line in lines[:5_000]]
    assert {len(row) for row in rows} == {40}
    columns = list(zip(*rows))
    hex_id = re.compile(r"[0-9a-f]{8}")
    for j, column in enumerate(columns[14:]):
        assert all(v == "" or hex_id.fullmatch(v) for v in column), f"C{j + 1}"
    for k, column in enumerate(columns[1:14]):
        assert all(v == "" or re.fullmatch(r"-?\d+", v) for v in column), f"I{k + 1}"
    assert any(v.startswith("-") for v in columns[2])  # I2 has small negatives, as in Kaggle
    assert all(int(v) >= -3 for v in columns[2] if v)
    assert sum(v == "" for v in columns[1]) > 1_000  # I1 is often missing
    assert sum(v == "" for v in columns[14 + 21]) > 1_000  # so is C22
    cardinalities = [len(np.unique(column)) for column in read_tsv(path, RAW).sparse.T]
    assert min(cardinalities) <= 5 and max(cardinalities) >= 1_000  # vocabularies of all sizes


def test_unlabelled_rows_are_the_labelled_rows_without_labels(tmp_path):
    labelled = write_synthetic_criteo(tmp_path / "labelled.tsv", 500, seed=4)
    unlabelled = write_synthetic_criteo(tmp_path / "unlabelled.tsv", 500, seed=4, labelled=False)
    assert unlabelled == labelled  # same rows, so the same (hidden) labels and AUC
    with_labels = (tmp_path / "labelled.tsv").read_text().splitlines()
    without = (tmp_path / "unlabelled.tsv").read_text().splitlines()
    assert without == [line.split("\t", 1)[1] for line in with_labels]
    arrays = read_tsv(tmp_path / "unlabelled.tsv", RAW)
    assert (arrays.labels == -1).all()
    np.testing.assert_array_equal(arrays.sparse, read_tsv(tmp_path / "labelled.tsv", RAW).sparse)


def test_the_file_holds_the_sampled_rows(tmp_path):
    write_synthetic_criteo(tmp_path / "a.tsv", 3, seed=5)
    rows = sample_rows(3, seed=5)
    arrays = read_tsv(tmp_path / "a.tsv", RAW)
    np.testing.assert_array_equal(arrays.labels, rows.labels)
    shown = np.where(rows.dense_missing, 0, np.maximum(rows.dense, 0))
    np.testing.assert_array_equal(arrays.dense, np.log1p(shown.astype(np.float64)).astype(np.float32))


def test_rank_auc_matches_pairwise_counting():
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 6, 60).astype(float)  # many ties
    labels = rng.random(60) < 0.4
    pairs = [(p, n) for p, n in itertools.product(scores[labels], scores[~labels])]
    expected = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in pairs) / len(pairs)
    assert rank_auc(scores, labels) == pytest.approx(expected, abs=1e-12)
    assert rank_auc([1, 2, 3], [0, 0, 1]) == 1.0 and rank_auc([3, 2, 1], [0, 0, 1]) == 0.0
    assert np.isnan(rank_auc([1, 2], [1, 1]))


def test_make_sample_script(tmp_path, monkeypatch, capsys):
    script = Path(__file__).resolve().parents[2] / "data" / "make_sample.py"
    spec = importlib.util.spec_from_file_location("make_sample", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert [(name, rows, seed, labelled) for name, rows, seed, labelled in module.SPLITS] == [
        ("val.tsv", 20_000, 2, True),
        ("test.tsv", 20_000, 3, True),
        ("predict.tsv", 5_000, 4, False),
        ("train.tsv", 200_000, 1, True),
    ]
    monkeypatch.setattr(module, "SPLITS", [(n, 300, s, lab) for n, _, s, lab in module.SPLITS])
    assert module.main(["--output", str(tmp_path / "sample")]) == 0
    assert sorted(p.name for p in (tmp_path / "sample").iterdir()) == [
        "predict.tsv", "test.tsv", "train.tsv", "val.tsv"
    ]
    assert "Bayes-optimal AUC" in capsys.readouterr().out
    predict = (tmp_path / "sample" / "predict.tsv").read_text().splitlines()
    assert len(predict) == 300 and all(len(line.split("\t")) == 39 for line in predict)
