"""One training run of the quality bench: ``fit`` through the app's command line in fresh processes,
and its best validation read back from the run's own metrics.csv."""

from __future__ import annotations

import csv
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Every run logs to one CSV logger under its own folder, whatever the recipe's loggers: the bench
# reads the validations from its metrics.csv (save_dir: the run's trainer.default_root_dir).
CSV_LOGGER = '[{"class_path": "app.train.loggers.RunCSVLogger", "init_args": {"name": "csv"}}]'
# The metrics every validation logs (app/train/metrics.py), by the name the bench reports.
REPORTED_METRICS = {"val_auc": "val/auc", "val_logloss": "val/logloss", "val_ne": "val/ne", "val_calibration": "val/calibration"}
# Logged only where the data has a group column (data.schema.group): None otherwise.
GROUP_METRICS = {"val_gauc": "val/gauc"}


@dataclass
class FinishedRun:
    """A run's folder (its metrics.csv and the config.yaml it ran with) and how long it took."""

    folder: Path
    wall_s: float

    @property
    def log_folder(self) -> Path:
        """The CSV logger's newest ``version_N`` folder (a reused run folder holds older ones)."""
        versions = sorted(self.folder.glob("csv/version_*"), key=lambda path: int(path.name.split("_")[1]))
        if not versions:
            raise ValueError(f"{self.folder}: the run wrote no csv/version_*/ (no RunCSVLogger?)")
        return versions[-1]


def fit(module: str, settings: list[str], folder: Path) -> FinishedRun:
    """``python -m <module> fit <settings>`` writing under ``folder`` (its default_root_dir, with the
    bench's CSV logger); its output goes to ``folder/fit.log``.

    Raises:
        ValueError: with the run's own ``error:`` line when the app refused a setting or a file.
        RuntimeError: with the end of the log when the run failed otherwise.
    """
    folder.mkdir(parents=True, exist_ok=True)
    # No checkpoints (the results are read from the metrics): a fit that saves them would go to <folder>-2
    # when a run_dir given again holds an earlier run's (app/checkpoint/run_folder.py), not where it is read.
    command = [sys.executable, "-m", module, "fit", *settings, "--trainer.default_root_dir", str(folder),
               "--trainer.logger", CSV_LOGGER, "--trainer.enable_checkpointing", "false"]  # fmt: skip
    log = folder / "fit.log"
    start_s = time.perf_counter()
    with log.open("w") as out:
        finished = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, text=True)
    wall_s = time.perf_counter() - start_s
    if finished.returncode != 0:
        text = log.read_text(errors="replace")
        refusal = next((line for line in text.splitlines() if line.startswith("error: ")), None)
        if refusal is not None:
            raise ValueError(f"{module} fit refused: {refusal.removeprefix('error: ')}")
        raise RuntimeError(f"{' '.join(command)} exited {finished.returncode} (log: {log}):\n{text[-3000:]}")
    return FinishedRun(folder, wall_s)


@dataclass
class RunMetrics:
    """What a run's metrics.csv says: every validation in order (its epoch and step, counted from 0 as
    Lightning writes them, and the reported metrics), and the last epoch and step it logged at all."""

    validations: list[dict[str, Any]]
    last_epoch: int
    last_step: int


def read_metrics(metrics_csv: Path) -> RunMetrics:
    """The validations and the extent of a run, from its metrics.csv."""
    with metrics_csv.open() as f:
        # Lightning's own rows; callbacks that write to the logger directly (rank_health) leave epoch empty.
        rows = [row for row in csv.DictReader(f) if row.get("epoch")]
    validations = [
        {"epoch": int(row["epoch"]), "step": int(row["step"]),
         **{key: float(row[name]) for key, name in REPORTED_METRICS.items()},
         **{key: float(row[name]) if row.get(name) else None for key, name in GROUP_METRICS.items()}}
        for row in rows
        if row.get("val/auc")
    ]  # fmt: skip
    if not validations:
        raise ValueError(f"{metrics_csv}: no validation was written (val/auc); the run needs validation rows (val)")
    return RunMetrics(validations, max(int(row["epoch"]) for row in rows), max(int(row["step"]) for row in rows))


def best_validation(metrics: RunMetrics, global_batch_size: int | None) -> dict[str, Any]:
    """The validation with the highest AUC (the first of equals), and what the run had trained by then
    and in all.

    Lightning logs at the step of the last batch trained, counted from 0: the batches trained by then
    are step + 1. Training batches are whole (the data module drops the remainder), so the rows
    trained are batches x the global batch size (None where the bench cannot tell the world size).
    """
    best = max(metrics.validations, key=lambda v: v["val_auc"])  # max keeps the first of equal AUCs
    return {
        **{key: best[key] for key in REPORTED_METRICS},
        **{key: best.get(key) for key in GROUP_METRICS},  # at the same validation: the best by AUC
        "best_epoch": best["epoch"] + 1,
        "best_step": best["step"] + 1,
        "rows_trained_at_best": _rows(best["step"] + 1, global_batch_size),
        "epochs_trained": metrics.last_epoch + 1,
        "steps_trained": metrics.last_step + 1,
        "rows_trained": _rows(metrics.last_step + 1, global_batch_size),
        "val_auc_per_validation": [v["val_auc"] for v in metrics.validations],
    }


def _rows(batches: int, global_batch_size: int | None) -> int | None:
    return None if global_batch_size is None else batches * global_batch_size
