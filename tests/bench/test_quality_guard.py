"""python -m app.bench.quality_guard: a lever's AUC and log loss beside the run without it."""

from __future__ import annotations

import json

import pytest

from app.bench import quality_guard


def test_a_lever_that_changes_nothing_differs_by_exactly_zero(sample_dir, tmp_path, capsys):
    # The plain loop and TorchRec's pipeline train bit for bit alike (tests/train/test_pipeline.py): a real
    # pair of runs through `python -m app fit` whose differences must be exactly 0. Under bf16 autocast:
    # the pipelined step must run only its forward under autocast, as the plain loop does (a CPU
    # backward under autocast computes its matmuls in bf16 again, and the two would differ).
    data = ["--data.train", str(sample_dir / "train.tsv"), "--data.val", str(sample_dir / "val.tsv"), "--data.test", "null",
            "--data.predict", "null", "--data.cache_dir", str(tmp_path / "cache"), "--data.batch_size", "512",
            "--trainer.max_epochs", "1", "--trainer.precision", "bf16-mixed"]  # fmt: skip
    lines = quality_guard.main([
        "--baseline", '["--model.pipeline", "none"]', "--levers", '{"sparse_dist": ["--model.pipeline", "sparse_dist"]}',
        "--extra", json.dumps(data), "--output_dir", str(tmp_path / "runs"),
    ])  # fmt: skip
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert printed == lines and [line.get("run") for line in lines] == ["baseline", "sparse_dist", None]
    # 4,096 rows / (2 ranks x 512): 4 steps, one validation, written at step 3 (Lightning counts from 0).
    assert lines[0]["step"] == 3 and 0.5 < lines[0]["val_auc"] < 1
    summary = lines[-1]
    assert summary["sparse_dist_val_auc_minus_baseline"] == 0.0
    assert summary["sparse_dist_val_logloss_minus_baseline"] == 0.0
    assert summary["sparse_dist_same_steps"] and summary["auc_within_tolerance"]


def test_the_summary_says_which_lever_leaves_the_tolerance():
    lines = [{"run": "baseline", "val_auc": 0.770, "val_logloss": 0.47, "step": 196},
             {"run": "a", "val_auc": 0.7715, "val_logloss": 0.469, "step": 196},
             {"run": "b", "val_auc": 0.7675, "val_logloss": 0.48, "step": 196}]  # fmt: skip
    summary = quality_guard.summary(lines, 0.002)
    assert summary["a_val_auc_minus_baseline"] == pytest.approx(0.0015)
    assert summary["b_val_auc_minus_baseline"] == pytest.approx(-0.0025)
    assert summary["auc_within_tolerance"] is False
    assert quality_guard.summary(lines[:2], 0.002)["auc_within_tolerance"] is True


def test_a_recipe_that_never_validates_is_named(tmp_path):
    metrics = tmp_path / "metrics.csv"
    metrics.write_text("epoch,step,train/loss\n0,9,0.5\n")
    with pytest.raises(ValueError, match="metrics.csv: no validation was written"):
        quality_guard.final_validation(metrics)
