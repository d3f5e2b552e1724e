"""``python -m app.quality``: a recipe's validation quality beside a logistic regression's.

Trains the recipe (a config for ``python -m app fit``) as ``make run`` does, through the app's
command line in fresh processes, then the hashed logistic regression of
:mod:`app.quality.baseline` on the same rows and features: the recipe's resolved ``data`` and
``trainer`` sections (the same data module, table sizes, hashing, dense transform, batches,
strategy and processes), one run per baseline learning rate. Both are scored by the app's metrics
on the same validation rows; each run's best validation (by AUC) is kept. Prints one JSON line per
model: AUC, log loss, NE and calibration at the best validation, its epoch and step, the rows and
epochs trained; the recipe's line also the AUC difference from the baseline. Where the data has a
group column (``data.schema.group``), both lines also carry the GAUC (per-group AUC weighted by the
groups' rows, app/train/metrics.py) at that validation, and the recipe's line its difference from the
baseline's. Where the validation rows were written by app/data/synthetic.py (the bundled sample), both
lines carry the generator's Bayes-optimal AUC on them, the most any model can reach; for a Parquet
file that records its planted truth's AUC and GAUC (data/make_own_data.py), those.

Examples::

    python -m app.quality                                   # configs/demo.yaml on the bundled sample
    python -m app.quality --recipe configs/demo_dcn.yaml --epochs 3
    python -m app.quality --train data/kaggle/days_0_5.tsv --val data/kaggle/day_6.tsv --output quality.jsonl
    python -m app.quality --recipe_args '[--data.batch_size, 2048]' --baseline_learning_rates '[0.05, 0.1, 0.2]'
    python -m app.quality --help
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from app.quality.baseline import BaselineOptimizer
from app.quality.planted import bayes_optimal_auc, recorded_truth
from app.quality.runs import FinishedRun, best_validation, fit, read_metrics
from app.command import run_command
from app.data.splits import split_files

PROG = "python -m app.quality"
RECIPE_MODULE = "app"
BASELINE_MODULE = "app.quality.baseline"


def quality_bench(
    recipe: str = "configs/demo.yaml",
    train: str | list[str] | None = None,
    val: str | list[str] | None = None,
    epochs: int | None = None,
    recipe_args: list[str | int | float | bool | None] = [],
    baseline_optimizer: BaselineOptimizer = "adagrad",
    baseline_learning_rates: list[float] = [0.02, 0.05, 0.1],
    baseline_epochs: int = 5,
    bayes_auc: bool = True,
    output: str | None = None,
    run_dir: str | None = None,
) -> list[dict[str, Any]]:
    """Trains a recipe and a hashed logistic-regression baseline on the same rows and features, scores
    both on the same validation rows, and prints one JSON line per model (recipe first).

    Args:
        recipe: the app's config to train, as ``python -m app fit --config RECIPE`` (2 CPU processes
            for the demo, as ``make run``).
        train: training rows, in any form ``data.train`` takes (default: the recipe's).
        val: validation rows, in any form ``data.val`` takes (default: the recipe's).
        epochs: the recipe's ``trainer.max_epochs`` (default: the recipe's own).
        recipe_args: more settings of the recipe's run, as on the app's command line, e.g.
            ``[--data.frequency_threshold, 3]`` (YAML values as the command line writes them). The
            baseline takes the recipe's resolved ``data`` and ``trainer`` sections, so data and
            trainer settings reach it too; model settings do not.
        baseline_optimizer: the baseline's optimizer (``adagrad`` or ``sgd``) for the id weights (fused
            into the embedding backward) and the dense weights alike.
        baseline_learning_rates: one baseline run per learning rate; the one with the best validation
            AUC is reported (a modest tuning on the validation rows, as the best epoch is), with the
            AUC of every rate tried.
        baseline_epochs: epochs of each baseline run, validated as the recipe validates (every epoch
            unless its trainer says otherwise); the best validation counts.
        bayes_auc: report the Bayes-optimal AUC of the validation rows when they are raw TSV written by
            app/data/synthetic.py (reads them once more), or the AUC and GAUC a Parquet file records of
            its planted truth (off: null).
        output: also write the JSON lines to this file.
        run_dir: where the runs write (``recipe/``, ``baseline_lr_<rate>/``: logs, metrics.csv, the
            config each ran with); default: a temporary folder, removed at the end.
    """
    recipe_args = [command_line_word(value) for value in recipe_args]
    _check_settings(recipe, train, val, epochs, baseline_learning_rates, baseline_epochs, recipe_args)
    with tempfile.TemporaryDirectory(prefix="quality_bench_") as scratch:
        folder = Path(run_dir or scratch)
        recipe_settings = ["--config", recipe, *_data_settings(train, val), *_epoch_settings(epochs), *recipe_args]
        _progress(f"training the recipe {recipe} (python -m app fit; output in {folder / 'recipe' / 'fit.log'})")
        recipe_run = fit(RECIPE_MODULE, recipe_settings, folder / "recipe")
        resolved = yaml.safe_load((recipe_run.log_folder / "config.yaml").read_text())
        recipe_result = _result(recipe_run, resolved)
        _progress(f"recipe: best val AUC {recipe_result['val_auc']:.4f}{_gauc_words(recipe_result)} ({recipe_run.wall_s:.0f} s)")
        baselines = {
            rate: train_baseline(resolved, baseline_optimizer, rate, baseline_epochs, folder / f"baseline_lr_{rate:g}")
            for rate in baseline_learning_rates
        }
    ceiling = _bayes_optimal(resolved["data"]) if bayes_auc else (None, None)
    lines = result_lines(recipe, recipe_args, resolved, recipe_result, baselines, baseline_optimizer, baseline_epochs, ceiling)
    for line in lines:
        print(json.dumps(line), flush=True)
    if output:
        Path(output).write_text("".join(json.dumps(line) + "\n" for line in lines))
    return lines


def _check_settings(
    recipe: str, train: Any, val: Any, epochs: int | None, learning_rates: list[float], baseline_epochs: int,
    recipe_args: list[str],
) -> None:  # fmt: skip
    """Refuses, naming the setting, what would fail only after a run (before any training)."""
    if not Path(recipe).is_file():
        raise FileNotFoundError(f"recipe: {recipe} does not exist")
    if epochs is not None and epochs < 1:
        raise ValueError(f"epochs = {epochs}: must be at least 1")
    if baseline_epochs < 1:
        raise ValueError(f"baseline_epochs = {baseline_epochs}: must be at least 1")
    if not learning_rates or any(not rate > 0 for rate in learning_rates):
        raise ValueError(f"baseline_learning_rates = {learning_rates}: give one or more rates > 0")
    if len(set(learning_rates)) != len(learning_rates):
        raise ValueError(f"baseline_learning_rates = {learning_rates}: a rate is given twice")
    for name, spec in (("train", train), ("val", val)):
        if spec is not None:
            split_files({name: spec}, None, None, "auto", [name])  # FileNotFoundError naming data.<name>
    if val is None and not _recipe_validates(recipe, recipe_args, split_replaced=train is not None):
        raise ValueError(f"val: {recipe} has no validation rows of its own (data.val or data.split); give val")


def command_line_word(value: str | int | float | bool | None) -> str:
    """A value of ``recipe_args`` as the app's command line reads it (YAML: ``true``, ``null``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _recipe_validates(recipe: str, recipe_args: list[str], split_replaced: bool) -> bool:
    """Whether the recipe names validation rows (its data.split does not count when train replaces it)."""
    data = (yaml.safe_load(Path(recipe).read_text()) or {}).get("data") or {}
    named = {arg.split("=")[0] for arg in recipe_args}
    if data.get("val") or (data.get("split") and not split_replaced):
        return True
    return bool({"--data.val", "--config"} & named) or ("--data.split" in named and not split_replaced)


def _data_settings(train: Any, val: Any) -> list[str]:
    """The rows given to the bench, in place of the recipe's (a standard split of the recipe's is
    then left out: it would replace them)."""
    if train is None and val is None:
        return []
    settings = ["--data.split", "null", "--data.root", "null"]
    for name, spec in (("train", train), ("val", val)):
        if spec is not None:
            settings += [f"--data.{name}", spec if isinstance(spec, str) else json.dumps(spec)]
    return settings


def _epoch_settings(epochs: int | None) -> list[str]:
    return [] if epochs is None else ["--trainer.max_epochs", str(epochs)]


def train_baseline(resolved: dict[str, Any], optimizer: str, learning_rate: float, epochs: int, folder: Path) -> dict[str, Any]:
    """One baseline run on the recipe's resolved data and trainer (its config kept as ``baseline.yaml``)."""
    folder.mkdir(parents=True, exist_ok=True)
    config_file = folder / "baseline.yaml"
    config_file.write_text(yaml.safe_dump(baseline_config(resolved, optimizer, learning_rate, epochs), sort_keys=False))
    _progress(f"training the logistic regression, {optimizer} lr {learning_rate:g} ({BASELINE_MODULE})")
    run = fit(BASELINE_MODULE, ["--config", str(config_file)], folder)
    result = _result(run, resolved)
    _progress(f"baseline lr {learning_rate:g}: best val AUC {result['val_auc']:.4f}{_gauc_words(result)} ({run.wall_s:.0f} s)")
    return result


def baseline_config(resolved: dict[str, Any], optimizer: str, learning_rate: float, epochs: int) -> dict[str, Any]:
    """The baseline's config: the recipe's resolved seed, data and trainer (the run's folder, loggers
    and epochs the bench's own; no checkpoints: the best validation is read from the metrics), and
    the logistic regression as the model."""
    trainer = dict(resolved["trainer"])
    trainer.update(max_epochs=epochs, max_steps=-1, enable_checkpointing=False)
    for key in ("default_root_dir", "logger"):  # set by the bench's command line
        trainer.pop(key, None)
    return {
        "seed_everything": resolved.get("seed_everything", 0),
        "trainer": trainer,
        "data": resolved["data"],
        "model": {"optimizer": optimizer, "learning_rate": learning_rate},
    }


def global_batch_size(resolved: dict[str, Any]) -> int | None:
    """Rows per training step on all ranks: data.batch_size x processes (None where trainer.devices is
    not a count or a list, e.g. ``auto``)."""
    trainer = resolved["trainer"]
    devices = trainer.get("devices")
    if isinstance(devices, str) and devices.strip().isdigit():
        devices = int(devices)
    if isinstance(devices, list):
        devices = len(devices)
    if not isinstance(devices, int) or devices < 1:
        return None
    return resolved["data"]["batch_size"] * devices * int(trainer.get("num_nodes") or 1)


def _result(run: FinishedRun, resolved: dict[str, Any]) -> dict[str, Any]:
    return {**best_validation(read_metrics(run.log_folder / "metrics.csv"), global_batch_size(resolved)), "wall_s": run.wall_s}


def _bayes_optimal(data: dict[str, Any]) -> tuple[float | None, float | None]:
    """The planted truth's AUC and GAUC on the validation rows the runs scored (None: not known)."""
    specs = {name: data[name] for name in ("val",) if data.get(name) is not None}
    files = split_files(specs, data.get("split"), data.get("root"), data.get("format", "auto"), ["val"]).get("val")
    if files is not None and files.format == "parquet":
        return recorded_truth(files.files, files.part)
    if files is None or files.format != "tsv":
        return None, None
    return bayes_optimal_auc(files.files, files.part, data.get("on_bad_rows", "error")), None


def result_lines(
    recipe: str,
    recipe_args: list[str],
    resolved: dict[str, Any],
    recipe_result: dict[str, Any],
    baselines: dict[float, dict[str, Any]],
    baseline_optimizer: str,
    baseline_epochs: int,
    bayes_optimal: tuple[float | None, float | None],
) -> list[dict[str, Any]]:
    """The recipe's line and the best baseline's."""
    best_rate = max(baselines, key=lambda rate: baselines[rate]["val_auc"])
    baseline = baselines[best_rate]
    data = resolved["data"]
    common = {
        "bench": "quality",
        "train": data.get("train") or f"{data.get('split')}: {data.get('root')}",
        "val": data.get("val") or f"{data.get('split')}: {data.get('root')}",
        "seed": resolved.get("seed_everything"),
        "val_bayes_optimal_auc": bayes_optimal[0],
        "val_bayes_optimal_gauc": bayes_optimal[1],
    }
    recipe_line = {
        **common, "model": "recipe", "recipe": recipe, "recipe_args": recipe_args, **recipe_result,
        "val_auc_minus_baseline": recipe_result["val_auc"] - baseline["val_auc"],
        "val_gauc_minus_baseline": _difference(recipe_result["val_gauc"], baseline["val_gauc"]),
        "beats_baseline": recipe_result["val_auc"] >= baseline["val_auc"],
    }  # fmt: skip
    baseline_line = {
        **common, "model": "logistic_regression", "optimizer": baseline_optimizer, "learning_rate": best_rate,
        "max_epochs": baseline_epochs, **baseline,
        "val_auc_per_learning_rate": {f"{rate:g}": result["val_auc"] for rate, result in baselines.items()},
    }  # fmt: skip
    return [recipe_line, baseline_line]


def _gauc_words(result: dict[str, Any]) -> str:
    return "" if result["val_gauc"] is None else f", GAUC {result['val_gauc']:.4f}"


def _difference(recipe: float | None, baseline: float | None) -> float | None:
    return None if recipe is None or baseline is None else recipe - baseline


def _progress(message: str) -> None:
    print(f"quality bench: {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m app.quality [OPTIONS]``; returns the exit status."""
    try:
        return run_command(quality_bench, PROG, argv)
    except RuntimeError as error:  # a run failed for another reason than a refused setting
        print(f"error: {error}", file=sys.stderr)
        return 1
