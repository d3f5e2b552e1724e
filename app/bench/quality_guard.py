"""``python -m app.bench.quality_guard``: what each speed lever does to a recipe's AUC and log loss.

Trains the recipe (default: the ``make run`` demo, ``configs/demo.yaml``) once with the levers off
(``--baseline``: the same seed, the same steps) and once per lever (``--levers``: a name and the
command-line settings that turn it on), each as ``python -m app fit`` in fresh processes, and prints
one JSON line per run (the last validation's AUC and log loss, from the run's own metrics.csv) and a
summary line: each lever's AUC and log-loss difference from the baseline, and whether the AUC is
within ``--auc_tolerance`` of it. ``make bench`` runs it after the speed benchmark.

Examples::

    python -m app.bench.quality_guard
    python -m app.bench.quality_guard --levers '{"compile": ["--model.compile", "true"]}'
    python -m app.bench.quality_guard --recipe configs/demo_dcn.yaml --auc_tolerance 0.001
    python -m app.bench.quality_guard --help
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from jsonargparse import ArgumentParser

ROOT = Path(__file__).resolve().parents[2]

# The levers of docs/performance.md that run on CPU, each as the settings that turn it on.
DEFAULT_LEVERS: dict[str, list[str]] = {
    "bf16_autocast": ["--trainer.precision", "bf16-mixed"],
    "compile": ["--model.compile", "true"],
    "qcomms_fp16": ["--trainer.strategy.init_args.qcomms", "{forward_precision: fp16, backward_precision: fp16}"],
}
DEFAULT_BASELINE = ["--model.compile", "false", "--trainer.precision", "32-true"]


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="python -m app.bench.quality_guard", description=__doc__)
    parser.add_argument("--recipe", type=str, default="configs/demo.yaml", help="the app's config to train (python -m app fit --config)")
    parser.add_argument("--baseline", type=list[str], default=DEFAULT_BASELINE, help="settings of the run without the levers")
    parser.add_argument("--levers", type=dict[str, list[str]], default=DEFAULT_LEVERS, help="name -> settings that turn a lever on")
    parser.add_argument("--extra", type=list[str], default=[], help="settings given to every run (e.g. --trainer.max_steps 50)")
    parser.add_argument("--auc_tolerance", type=float, default=0.002, help="largest AUC difference from the baseline that passes")
    parser.add_argument("--output_dir", type=str | None, default=None, help="where the runs write (default: a temporary folder)")
    return parser


def final_validation(metrics_csv: Path) -> dict[str, float]:
    """The last row of a run's metrics.csv that holds ``val/auc``: its AUC, log loss and step."""
    with metrics_csv.open() as f:
        rows = [row for row in csv.DictReader(f) if row.get("val/auc")]
    if not rows:
        raise ValueError(f"{metrics_csv}: no validation was written (val/auc); does the recipe validate?")
    last = rows[-1]
    return {"val_auc": float(last["val/auc"]), "val_logloss": float(last["val/logloss"]), "step": int(last["step"])}


def train(recipe: str, settings: list[str], root: Path) -> dict[str, float]:
    """``python -m app fit`` of the recipe with ``settings``, writing under ``root``; its last validation."""
    # No checkpoints (the result is read from the metrics): a fit that saves them would go to <root>-2 when an
    # output_dir given again holds an earlier run's (app/checkpoint/run_folder.py), not where it is read.
    command = [sys.executable, "-m", "app", "fit", "--config", recipe, *settings, "--trainer.default_root_dir", str(root),
               "--trainer.enable_checkpointing", "false"]  # fmt: skip
    finished = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if finished.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {finished.returncode}:\n{finished.stderr[-3000:]}")
    (metrics_csv,) = sorted(root.glob("csv/version_*/metrics.csv"))[-1:] or [None]
    if metrics_csv is None:
        raise ValueError(f"{root}: the run wrote no csv/version_*/metrics.csv; the recipe needs the app's RunCSVLogger")
    return final_validation(metrics_csv)


def summary(lines: list[dict[str, Any]], auc_tolerance: float) -> dict[str, Any]:
    """Each lever's differences from the baseline (the first line)."""
    baseline, levers = lines[0], lines[1:]
    result: dict[str, Any] = {"summary": True, "baseline_val_auc": baseline["val_auc"], "auc_tolerance": auc_tolerance}
    for line in levers:
        name = line["run"]
        result[f"{name}_val_auc_minus_baseline"] = line["val_auc"] - baseline["val_auc"]
        result[f"{name}_val_logloss_minus_baseline"] = line["val_logloss"] - baseline["val_logloss"]
        result[f"{name}_same_steps"] = line["step"] == baseline["step"]
    result["auc_within_tolerance"] = all(abs(line["val_auc"] - baseline["val_auc"]) <= auc_tolerance for line in levers)
    return result


def main(args: list[str] | None = None) -> list[dict[str, Any]]:
    """Runs the baseline and every lever; prints and returns the JSON lines."""
    config = build_parser().parse_args(sys.argv[1:] if args is None else args)
    runs = {"baseline": config.baseline, **config.levers}
    lines = []
    with tempfile.TemporaryDirectory(prefix="quality_guard_") as scratch:
        output_dir = Path(config.output_dir or scratch)
        for name, settings in runs.items():
            try:
                measured = train(config.recipe, [*settings, *config.extra], output_dir / name)
            except (RuntimeError, ValueError) as error:
                print(f"error: quality guard run {name!r}: {error}", file=sys.stderr)
                raise SystemExit(1) from None
            line = {"bench": "quality_guard", "recipe": config.recipe, "run": name, "settings": settings, **measured}
            print(json.dumps(line), flush=True)
            lines.append(line)
    lines.append(summary(lines, config.auc_tolerance))
    print(json.dumps(lines[-1]), flush=True)
    return lines


if __name__ == "__main__":
    main()
