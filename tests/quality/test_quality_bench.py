"""python -m app.quality: a recipe and the logistic-regression baseline on the same rows."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from app.quality import bench, planted
from app.quality.baseline import ROW_WIDTH, LogisticRegressionModule
from app.quality.runs import RunMetrics, best_validation, read_metrics
from app.data.batches import make_batch
from app.data.source import RowBlock
from app.data.synthetic import write_synthetic_criteo

LINE_KEYS = {
    "bench", "model", "train", "val", "seed", "val_auc", "val_logloss", "val_ne", "val_calibration", "best_epoch",
    "best_step", "rows_trained_at_best", "epochs_trained", "steps_trained", "rows_trained", "val_auc_per_validation",
    "wall_s", "val_bayes_optimal_auc", "val_gauc", "val_bayes_optimal_gauc",
}  # fmt: skip


def _own_data_generator():
    spec = importlib.util.spec_from_file_location("make_own_data", Path("data/make_own_data.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_bench_trains_the_recipe_and_the_baseline_on_the_same_rows(tmp_path, capsys):
    # docs/own-data.md's logs, with a group column and a list column: 4,096 training rows in global
    # batches of 2 x 512, 4 steps per epoch; 819 validation rows. Its config names its own files, so
    # the rows follow it in recipe_args (a --train would come before it).
    truth = _own_data_generator().write_files(tmp_path / "own", 4_096, seed=0)["val"]
    argv = [
        "--recipe", "configs/demo.yaml", "--epochs", "1",
        "--recipe_args", json.dumps(["--config", "configs/own_data.yaml", "--data.train", str(tmp_path / "own" / "train.parquet"),
                                     "--data.val", str(tmp_path / "own" / "val.parquet"), "--data.predict", None,
                                     "--data.batch_size", "512", "--data.cache_dir", str(tmp_path / "cache"),
                                     "--trainer.enable_checkpointing", "false"]),
        "--baseline_epochs", "2", "--baseline_learning_rates", "[0.1]",
        "--output", str(tmp_path / "quality.jsonl"), "--run_dir", str(tmp_path / "runs"),
    ]  # fmt: skip
    assert bench.main(argv) == 0
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    written = [json.loads(line) for line in (tmp_path / "quality.jsonl").read_text().splitlines()]
    assert printed == written and [line["model"] for line in printed] == ["recipe", "logistic_regression"]
    recipe, baseline = printed
    for line in printed:
        assert LINE_KEYS <= set(line)
        assert 0 < line["val_auc"] < 1 and line["val_logloss"] > 0 and line["val_ne"] > 0 and line["val_calibration"] > 0
        assert line["val_auc"] == max(line["val_auc_per_validation"])
        assert 0 < line["val_gauc"] < 1  # both models, per user (the schema's group)
        # The ceiling the generator recorded in the validation file.
        ceiling = (line["val_bayes_optimal_auc"], line["val_bayes_optimal_gauc"])
        assert ceiling == (truth["planted_truth_auc"], truth["planted_truth_gauc"])
    assert (recipe["epochs_trained"], recipe["steps_trained"], recipe["rows_trained"]) == (1, 4, 4_096)
    assert (baseline["epochs_trained"], baseline["steps_trained"], baseline["rows_trained"]) == (2, 8, 8_192)
    # Validated as the recipe's trainer says: the demo's twice an epoch (2 of its 4 steps).
    assert len(recipe["val_auc_per_validation"]) == 2 and len(baseline["val_auc_per_validation"]) == 4
    assert baseline["rows_trained_at_best"] == baseline["best_step"] * 1_024
    assert (baseline["optimizer"], baseline["learning_rate"], baseline["max_epochs"]) == ("adagrad", 0.1, 2)
    assert baseline["val_auc_per_learning_rate"] == {"0.1": baseline["val_auc"]}
    assert recipe["val_auc_minus_baseline"] == recipe["val_auc"] - baseline["val_auc"]
    assert recipe["val_gauc_minus_baseline"] == recipe["val_gauc"] - baseline["val_gauc"]
    # The same rows, features and trainer: the baseline ran the recipe's resolved data section as is.
    ran = {name: yaml.safe_load(next((tmp_path / "runs" / name).glob("csv/version_*/config.yaml")).read_text())
           for name in ("recipe", "baseline_lr_0.1")}  # fmt: skip
    assert ran["baseline_lr_0.1"]["data"] == ran["recipe"]["data"]
    assert ran["baseline_lr_0.1"]["trainer"]["strategy"] == ran["recipe"]["trainer"]["strategy"]
    assert ran["baseline_lr_0.1"]["trainer"]["devices"] == ran["recipe"]["trainer"]["devices"] == 2


def _table_weights(table: int, num_rows: int) -> torch.Tensor:
    """Row i of table j holds (j + 1) (i + 1) (1, 2, 3, 4) / 64: an id's weight (the row's sum) is
    (j + 1) (i + 1) 10 / 64, exact in float32."""
    rows = torch.arange(1, num_rows + 1, dtype=torch.float32)[:, None]
    return (table + 1) * rows * torch.arange(1, ROW_WIDTH + 1, dtype=torch.float32)[None, :] / 64


def test_the_baseline_logit_is_the_sum_of_the_ids_weights_plus_the_dense_layer():
    module = LogisticRegressionModule(num_embeddings_per_feature=3)
    module.embeddings.to_empty(device="cpu")  # built on the meta device for the sharder
    for table, weight in enumerate(module.embeddings.embedding_bags.values()):
        weight.weight.data.copy_(_table_weights(table, 3))
    with torch.no_grad():
        module.dense.weight.copy_(torch.tensor([[0.5, -1.0] + [0.0] * 10 + [2.0]]))
        module.dense.bias.fill_(0.25)
    sparse = np.zeros((2, 26), dtype=np.int64)
    sparse[1] = 2  # row 1: the third id of every feature
    sparse[1, 0] = 1
    dense = np.zeros((2, 13), dtype=np.float32)
    dense[0, :2] = [2.0, 1.0]
    dense[1, 12] = 0.5
    batch = make_batch(RowBlock(dense, sparse, np.array([0.0, 1.0], dtype=np.float32)), np.arange(2))
    logits = module(batch)
    # Row 0: ids 0 -> sum_j (j + 1) 10 / 64 = 351 x 10 / 64 = 54.84375; dense 0.5 x 2 - 1 x 1 + 0.25.
    # Row 1: feature 0 id 1 -> 2 x 10 / 64; the others id 2 -> (351 - 1) x 3 x 10 / 64; dense 2 x 0.5 + 0.25.
    assert logits.tolist() == [54.84375 + 0.25, 20 / 64 + 350 * 30 / 64 + 1.25]


def test_the_baselines_config_is_the_recipes_data_and_trainer_with_its_own_model_and_epochs():
    resolved = {
        "seed_everything": 7,
        "trainer": {"devices": 2, "max_epochs": 2, "max_steps": 100, "logger": [{"class_path": "x"}],
                    "default_root_dir": "runs/demo", "val_check_interval": 50, "enable_checkpointing": None},
        "data": {"train": "a.tsv", "val": "b.tsv", "batch_size": 1024, "num_embeddings_per_feature": "auto"},
        "model": {"interaction": "dot"},
        "checkpoint": {"monitor": "val/auc"},
    }  # fmt: skip
    config = bench.baseline_config(resolved, "adagrad", 0.05, 3)
    assert config == {
        "seed_everything": 7,
        "trainer": {"devices": 2, "max_epochs": 3, "max_steps": -1, "val_check_interval": 50, "enable_checkpointing": False},
        "data": resolved["data"],
        "model": {"optimizer": "adagrad", "learning_rate": 0.05},
    }
    assert bench.global_batch_size(resolved) == 2_048
    assert bench.global_batch_size({**resolved, "trainer": {"devices": "auto"}}) is None


def test_the_best_validation_is_the_first_highest_auc_and_rows_count_whole_batches():
    validations = [
        {"epoch": e, "step": s, "val_auc": auc, "val_logloss": 0.5, "val_ne": 0.9, "val_calibration": 1.0}
        for e, s, auc in [(0, 9, 0.70), (1, 19, 0.72), (2, 29, 0.72), (3, 39, 0.71)]
    ]
    best = best_validation(RunMetrics(validations, last_epoch=3, last_step=39), global_batch_size=256)
    assert (best["val_auc"], best["best_epoch"], best["best_step"], best["rows_trained_at_best"]) == (0.72, 2, 20, 5_120)
    assert (best["epochs_trained"], best["steps_trained"], best["rows_trained"]) == (4, 40, 10_240)


def test_gauc_is_read_at_the_best_auc_validation_where_the_data_has_groups(tmp_path):
    # Lightning's metrics.csv: one row per validation (val/ columns) and per logged training step.
    header = "epoch,step,train/loss,val/auc,val/calibration,val/gauc,val/logloss,val/ne\n"
    (tmp_path / "grouped.csv").write_text(header + "0,9,0.5,,,,,\n0,9,,0.70,1.0,0.61,0.5,0.9\n1,19,,0.72,1.0,0.60,0.5,0.9\n")
    (tmp_path / "plain.csv").write_text(header.replace("val/gauc,", "") + "0,9,,0.70,1.0,0.5,0.9\n")
    assert best_validation(read_metrics(tmp_path / "grouped.csv"), 256)["val_gauc"] == 0.60
    assert best_validation(read_metrics(tmp_path / "plain.csv"), 256)["val_gauc"] is None
    resolved = {"data": {"train": "t.parquet", "val": "v.parquet"}, "seed_everything": 0}
    recipe, baseline = {"val_auc": 0.75, "val_gauc": 0.71}, {"val_auc": 0.72, "val_gauc": 0.66}
    lines = bench.result_lines("r.yaml", [], resolved, recipe, {0.1: baseline}, "adagrad", 3, (0.82, 0.79))
    assert lines[0]["val_gauc_minus_baseline"] == 0.71 - 0.66 and lines[1]["val_gauc"] == 0.66
    assert [(line["val_bayes_optimal_auc"], line["val_bayes_optimal_gauc"]) for line in lines] == [(0.82, 0.79)] * 2


def test_the_bayes_optimal_auc_is_the_generators_and_none_for_other_rows(tmp_path):
    summary = write_synthetic_criteo(tmp_path / "rows.tsv", 3_000, seed=5)
    assert planted.bayes_optimal_auc([tmp_path / "rows.tsv"]) == summary.bayes_auc
    # The bench's own lookup on its resolved data section: raw TSV has no GAUC ceiling.
    assert bench._bayes_optimal({"val": str(tmp_path / "rows.tsv"), "format": "auto"}) == (summary.bayes_auc, None)
    # The reader's missing id (0) is no id of the generator's: 0 can stand for missing.
    assert all((hashes != 0).all() for hashes in planted.world_id_hashes())
    lines = (tmp_path / "rows.tsv").read_text().splitlines()
    foreign = lines[0].split("\t")
    foreign[14] = next(f"{v:08x}" for v in range(1, 1000) if v not in set(planted.world_id_hashes()[0].tolist()))
    (tmp_path / "other.tsv").write_text("\n".join(["\t".join(foreign), *lines[1:]]) + "\n")
    assert planted.bayes_optimal_auc([tmp_path / "other.tsv"]) is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--recipe", "configs/none.yaml"], "error: recipe: configs/none.yaml does not exist"),
        (["--baseline_epochs", "0"], "error: baseline_epochs = 0: must be at least 1"),
        (["--baseline_learning_rates", "[0.1, -1]"], "error: baseline_learning_rates = [0.1, -1.0]: give one or more rates > 0"),
        (["--val", "missing/val.tsv"], "error: data.val:"),
    ],
)
def test_bad_settings_are_refused_in_one_line_before_any_training(argv, message, tmp_path, capsys):
    assert bench.main([*argv, "--run_dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith(message)
    assert not any(tmp_path.iterdir())
