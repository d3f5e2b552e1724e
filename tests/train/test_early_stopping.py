"""Early stopping and ``--ckpt_path best`` through ``python -m app`` as a user runs them (Lightning's
launcher, 2 CPU processes): one fit that validates every 6 steps and stops once val/auc has not risen
for 2 validations; then, in new processes, ``best`` resolves to that run's best checkpoint for
validate and export, and the refused cases end with one line before any worker starts."""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import pytest

from app.checkpoint.best import find_best_checkpoint
from app.checkpoint.export import main as export_main
from app.cli import cli_main
from tests.multiprocess import DEMO_BEFORE_QUALITY_SETTINGS
from tests.checkpoint.test_checkpoint_runs import run_app

PATIENCE = 2
EARLY_STOPPING_YAML = f"early_stopping:\n  monitor: val/auc\n  mode: max\n  patience: {PATIENCE}\n"


def run_args(sample: dict[str, Path], root: Path) -> list[str]:
    """A tiny model on 1,536 rows: 12 steps per epoch on 2 processes, a validation every 6 steps."""
    return [
        "--config", "configs/demo.yaml", *DEMO_BEFORE_QUALITY_SETTINGS,
        "--data.train", str(sample["train"]), "--data.val", str(sample["val"]),
        "--data.test", "null", "--data.predict", "null", "--data.cache_dir", str(root / "cache"),
        "--data.batch_size", "64", "--data.num_embeddings_per_feature", "500",
        "--model.embedding_dim", "8", "--model.dense_arch_layer_sizes", "[16, 8]",
        "--model.over_arch_layer_sizes", "[16, 1]",
        "--trainer.max_epochs", "6", "--trainer.val_check_interval", "6",
        "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(root),
        "--trainer.logger", "app.train.loggers.RunCSVLogger", "--trainer.logger.init_args.name", "csv",
    ]  # fmt: skip


def validations(root: Path, version: int) -> list[dict[str, str]]:
    with (root / "csv" / f"version_{version}" / "metrics.csv").open() as f:
        return [row for row in csv.DictReader(f) if row.get("val/auc")]


@pytest.fixture(scope="module")
def stopped(sample, tmp_path_factory) -> Path:
    """The fit, with early stopping asked for in a second YAML config, as a recipe would."""
    root = tmp_path_factory.mktemp("stopped")
    (root / "early_stopping.yaml").write_text(EARLY_STOPPING_YAML)
    result = run_app("fit", *run_args(sample, root), "--config", str(root / "early_stopping.yaml"))
    assert result.returncode == 0, result.stderr[-3000:]
    (root / "fit.log").write_text(result.stdout + result.stderr)
    return root


def test_fit_stops_after_patience_validations_without_a_better_val_auc(stopped):
    checks = validations(stopped, 0)
    aucs = [float(row["val/auc"]) for row in checks]
    # EarlyStopping's rule replayed on the logged values: stop at the first validation that is the
    # PATIENCE-th in a row not above the best before it.
    best_so_far, waited, stop_at = float("-inf"), 0, None
    for index, auc in enumerate(aucs):
        best_so_far, waited = (auc, 0) if auc > best_so_far else (best_so_far, waited + 1)
        if waited == PATIENCE:
            stop_at = index
            break
    assert stop_at == len(checks) - 1, aucs  # stopped right there, and not before
    # The steps below, and the best checkpoint the tests after name, hold on any CPU only while no decision
    # is close: each validation's AUC is at least 4.5e-3 from the best before it here (0.666 at step 24
    # against 0.670 at 18). Other CPUs' kernels move a float32 AUC by about 2.4e-4 (tests/model/test_model.py);
    # with ATen, MKL, oneDNN and FBGEMM capped at AVX2, or 1 to 4 threads, these AUCs did not move at all,
    # and bf16 autocast moved them by up to 7.2e-3 but stopped at the same step. A change that leaves a
    # decision within 1e-3 fails here, not on another CPU.
    assert min(abs(auc - max(aucs[:index])) for index, auc in enumerate(aucs) if index) > 1e-3, aucs
    # This seed: val/auc rises for 3 validations (steps 6, 12, 18), falls at 24 and 30; fit stops in the
    # middle of epoch 2 of 6, at step 30 (the CSV rows name the step before the update count).
    assert [(row["epoch"], row["step"]) for row in checks] == [("0", "5"), ("0", "11"), ("1", "17"), ("1", "23"), ("2", "29")]
    assert aucs.index(max(aucs)) == 2
    with (stopped / "csv" / "version_0" / "metrics.csv").open() as f:
        assert max(int(row["step"]) for row in csv.DictReader(f)) == 29  # no training after the stop
    log = (stopped / "fit.log").read_text()
    # Lightning prints the best score to 3 decimals: the logged maximum's, not a constant that a CPU could round apart.
    assert log.count(f"Monitored metric val/auc did not improve in the last 2 records. Best score: {max(aucs):.3f}.") == 1


def test_best_resolves_to_the_checkpoint_of_the_best_logged_val_auc(stopped):
    best = find_best_checkpoint(stopped / "checkpoints", "val/auc", "max")
    assert best.path == stopped / "checkpoints" / "epoch=1-step=18.ckpt"
    assert best.score == max(float(row["val/auc"]) for row in validations(stopped, 0))
    # Without a monitor given (export): the one the run ranked by.
    assert find_best_checkpoint(stopped / "checkpoints") == best


def test_validate_best_in_a_new_process_reports_the_best_validations_val_auc(stopped, sample):
    result = run_app("validate", *run_args(sample, stopped), "--config", str(stopped / "early_stopping.yaml"),
                     "--ckpt_path", "best")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"ckpt_path best: {stopped / 'checkpoints' / 'epoch=1-step=18.ckpt'} (val/auc" in result.stdout + result.stderr
    (validated,) = validations(stopped, 1)
    assert validated["val/auc"] == max((row["val/auc"] for row in validations(stopped, 0)), key=float)


def test_export_best_writes_the_best_checkpoint(stopped, tmp_path, capsys):
    export_main(["--ckpt_path", "best", "--checkpoint_dir", str(stopped / "checkpoints"), "--output", str(tmp_path / "m.pt")])
    best = stopped / "checkpoints" / "epoch=1-step=18.ckpt"
    assert f"exported 34 tensors from {best} to {tmp_path / 'm.pt'}" in capsys.readouterr().out


@pytest.mark.filterwarnings("ignore:LightningCLI's args parameter", "ignore:Unable to enable fault handler")
def test_fit_help_documents_the_group(capsys):
    try:
        cli_main(["fit", "--help"])
    except SystemExit as exit_info:  # torchelastic's @record may turn exit(0) into a return
        assert exit_info.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--early_stopping.monitor MONITOR the logged metric to watch, e.g. ``val/auc`` or ``val/logloss``; null (the default): off." in out
    assert "--early_stopping.patience PATIENCE number of checks with no improvement" in out  # Lightning's own


def refusal(args: list[str], capsys, monkeypatch) -> str:
    """The one error line of an in-process `python -m app` that must stop while parsing its settings."""
    monkeypatch.delenv("APP_TRACEBACK", raising=False)
    with pytest.raises(SystemExit) as stop:
        cli_main(args) if args[0] != "export" else export_main(args[1:])
    assert stop.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[-1] == "(set APP_TRACEBACK=1 to see the traceback)"
    return lines[-2]


@pytest.mark.filterwarnings("ignore:LightningCLI's args parameter", "ignore:Unable to enable fault handler")
def test_refused_before_any_worker_starts(stopped, sample, tmp_path, capsys, monkeypatch):
    args = ["validate", *run_args(sample, stopped), "--ckpt_path", "best"]
    assert refusal(args + ["--checkpoint.monitor", "null"], capsys, monkeypatch).startswith(
        "error: ckpt_path best: checkpoint.monitor is not set"
    )
    assert refusal(args + ["--checkpoint.mode", "min"], capsys, monkeypatch) == (
        f"error: ckpt_path best: {stopped / 'checkpoints' / 'last.ckpt'} records no best checkpoint by val/auc "
        "(mode min); it records: val/auc (mode max) (set checkpoint.monitor and checkpoint.mode as in the run that wrote it)"
    )
    empty = tmp_path / "empty"
    assert refusal(args + ["--trainer.default_root_dir", str(empty)], capsys, monkeypatch) == (
        f"error: ckpt_path best: no checkpoint in {empty / 'checkpoints'}; train with `python -m app fit` first"
    )
    assert not empty.exists()  # nothing started, nothing written
    # The best checkpoint deleted: last.ckpt still names it.
    copied = tmp_path / "copied"
    shutil.copytree(stopped / "checkpoints", copied, symlinks=True)
    (copied / "epoch=1-step=18.ckpt").unlink()
    assert refusal(args + ["--checkpoint.dirpath", str(copied)], capsys, monkeypatch) == (
        f"error: ckpt_path best: last.ckpt records epoch=1-step=18.ckpt as the best by val/auc, but "
        f"{copied / 'epoch=1-step=18.ckpt'} is gone or incomplete (deleted, or checkpoint.save_top_k 0?)"
    )
    assert refusal(["export", "--ckpt_path", "best"], capsys, monkeypatch) == (
        "error: export --ckpt_path best: name the run's checkpoint folder with --checkpoint_dir"
    )
    # Lightning's default mode is min: early stopping on val/auc would stop as soon as the AUC rose.
    fit = ["fit", *run_args(sample, tmp_path / "fit"), "--early_stopping.monitor", "val/auc"]
    assert refusal(fit, capsys, monkeypatch) == (
        "error: early_stopping.mode = min but checkpoint.mode = max for the same metric val/auc: "
        "set --early_stopping.mode max"
    )
    assert refusal(fit + ["--early_stopping.monitor", "val/ne", "--early_stopping.mode", "maximum"], capsys, monkeypatch) == (
        "error: early_stopping.mode = 'maximum': use min or max"
    )
