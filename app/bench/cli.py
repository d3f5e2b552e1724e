"""``python -m app.bench``: the app against a plain TorchRec loop, same model, data, optimizers and plan.

Examples::

    python -m app.bench                                   # the torchrec_reference preset (make bench)
    python -m app.bench --preset gaudi_medium --run.measured_steps 20
    python -m app.bench --config configs/bench/demo.yaml --data.batch_size_per_rank 2048
    python -m app.bench --preset torchrec_reference --app_variants '{"pipelined": {"pipeline": "sparse_dist"}}'
    python -m app.bench --preset demo --dataset.train data/sample/train.tsv --dataset.batch_size 1024
    python -m app.bench --preset demo --dataset.split kaggle --dataset.root /data/kaggle/train.txt \
        --dataset.num_embeddings_per_feature auto --dataset.cache_dir /scratch/criteo_cache
    python -m app.bench --help

``--preset NAME`` stands for ``--config configs/bench/NAME.yaml`` and, like it, is overridden by the
arguments after it. Prints one JSON line per run (per side and repeat), then one summary line with
``ratio_app_over_raw``: the median over repeats of the app's median samples/s over the plain loop's.

The batches are random (``data.*``) unless ``dataset.train`` or ``dataset.split`` names a Criteo
dataset in any format the app reads: both sides then train on the batches of the app's data module.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
from jsonargparse import ActionConfigFile, ArgumentParser, Namespace
from torch.multiprocessing.spawn import ProcessException

from app.bench.data import RandomData
from app.bench.dataset import GROUP_DESCRIPTION, GROUP_TITLE, SKIPPED_SETTINGS, dataset_settings, read_dataset
from app.bench.launch import run_on_ranks
from app.bench.measure import BUSY_FIELDS, gpu_busy, growth_over_expected, step_statistics
from app.bench.settings import BenchSpec, RunSettings, app_precision, check_can_run, check_run_settings, split_variant
from app.command import exit_on_bad_config_files
from app.train.precision import FLOAT32
from app.data.datamodule import CriteoDataModule
from app.distributed.strategy import TorchRecStrategy
from app.train.module import DLRMModule

PRESETS_DIR = Path(__file__).resolve().parents[2] / "configs" / "bench"
DEFAULT_PRESET = "torchrec_reference"
# The memory target: growth of each rank's resident memory over what it must hold.
MEMORY_TARGET_FACTOR = 1.1


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="python -m app.bench", description=__doc__)
    parser.add_argument("--config", action=ActionConfigFile, help="a YAML file of the settings below")
    parser.add_argument("--preset", type=str, help=f"a named config in configs/bench/ (default: {DEFAULT_PRESET})")
    parser.add_argument("--name", type=str, default="custom", help="the benchmark's name in the output")
    parser.add_class_arguments(RunSettings, "run")
    parser.add_class_arguments(RandomData, "data")
    parser.add_class_arguments(CriteoDataModule, "dataset", skip=SKIPPED_SETTINGS, help=GROUP_TITLE)
    parser.groups["dataset"].description = GROUP_DESCRIPTION  # type: ignore[attr-defined]
    # Table sizes come from the data; everything else is the app's model, as in `python -m app`.
    parser.add_class_arguments(DLRMModule, "model", skip={"num_embeddings_per_feature"})
    parser.add_class_arguments(TorchRecStrategy, "strategy")
    parser.add_argument(
        "--app_variants", type=dict[str, dict[str, Any]], default={},
        help="more runs of the app, by name, each with model settings of its own (e.g. model.pipeline, model.compile), "
        "strategy settings under 'strategy' (e.g. {strategy: {qcomms: ...}}), 'precision' (trainer.precision) and "
        "'progress_bar_refresh_rate' (the progress bar, off otherwise); each gets a ratio over the plain loop",
    )  # fmt: skip
    return parser


def expand_presets(args: list[str]) -> list[str]:
    """``--preset NAME`` becomes ``--config configs/bench/NAME.yaml``; no preset and no config: the default one."""
    expanded, i = [], 0
    while i < len(args):
        if args[i] == "--preset" or args[i].startswith("--preset="):
            name = args[i].split("=", 1)[1] if "=" in args[i] else (args[i + 1] if i + 1 < len(args) else "")
            i += 1 if "=" in args[i] else 2
            path = PRESETS_DIR / f"{name}.yaml"
            if not path.is_file():
                known = ", ".join(sorted(p.stem for p in PRESETS_DIR.glob("*.yaml")))
                raise ValueError(f"--preset {name!r}: no {path}; presets: {known}")
            expanded += ["--config", str(path)]
        else:
            expanded.append(args[i])
            i += 1
    if not any(a == "--config" or a.startswith("--config=") for a in expanded) and not {"-h", "--help"} & set(expanded):
        expanded = ["--config", str(PRESETS_DIR / f"{DEFAULT_PRESET}.yaml"), *expanded]
    return expanded


def spec_from(config: Namespace) -> BenchSpec:
    """The run's spec; a dataset is prepared here (raw TSV converted), before any process starts."""
    settings = dataset_settings(config.dataset.as_dict())
    run = RunSettings(**config.run.as_dict())
    if settings is not None:
        check_run_settings(run)  # before preparing the data, which may take long
    return BenchSpec(
        name=config.name,
        run=run,
        data=RandomData(**config.data.as_dict()),
        model=config.model.as_dict(),
        strategy=config.strategy.as_dict(),
        app_variants=dict(config.app_variants or {}),
        dataset=None if settings is None else read_dataset(settings, run.world_size),
    )


def main(args: list[str] | None = None) -> list[dict[str, Any]]:
    """Runs the benchmark; prints and returns the JSON lines."""
    try:
        expanded = expand_presets(sys.argv[1:] if args is None else args)
        exit_on_bad_config_files(expanded)  # a YAML error names its file, line and column
        config = build_parser().parse_args(expanded)
        spec = spec_from(config)
        check_can_run(spec)  # before any process starts
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    lines = []
    runs = _runs(spec)
    for repeat in range(spec.run.repeats):
        # Alternate which side goes first, so that drift in a shared machine's load hits both alike.
        for label, side, overrides in runs if repeat % 2 == 0 else runs[::-1]:
            try:
                ranks = run_on_ranks(spec, side, overrides, f"{label}_repeat{repeat}")
            except ProcessException as error:  # a rank raised, or was killed (e.g. out of memory)
                print(f"error: the {label} run failed on a rank:\n{error}", file=sys.stderr)
                raise SystemExit(1) from None
            lines.append(_emit(run_line(spec, label, repeat, ranks, overrides)))
    lines.append(_emit(summary_line(spec, lines)))
    return lines


def _runs(spec: BenchSpec) -> list[tuple[str, str, dict[str, Any]]]:
    runs = [(side, side, {}) for side in spec.run.sides]
    if "app" in spec.run.sides:
        runs += [(label, "app", overrides) for label, overrides in spec.app_variants.items()]
    return runs


def _emit(line: dict[str, Any]) -> dict[str, Any]:
    print(json.dumps(line), flush=True)
    return line


def run_line(spec: BenchSpec, label: str, repeat: int, ranks: list[dict[str, Any]], overrides: dict[str, Any]) -> dict:
    """One run's JSON line: rank 0's step statistics, every rank's memory (RSS, and HBM on GPUs), and
    what produced them; with profiled steps, rank 0's phase table (and on GPUs the embedding
    kernels' share of the HBM bandwidth)."""
    global_batch = spec.inputs.batch_size_per_rank * spec.run.world_size
    # Rows trained in each measured step on all ranks (measured step i trains batch warmup_steps + i).
    measured = slice(spec.run.warmup_steps, spec.run.warmup_steps + spec.run.measured_steps)
    samples_per_step = [sum(rows) for rows in zip(*(rank["rows_per_step"][measured] for rank in ranks))]
    memory = [{"rank": r, **rank["memory"], "growth_over_expected": growth_over_expected(rank["memory"])} for r, rank in enumerate(ranks)]
    model_overrides, strategy_overrides = split_variant(overrides)
    return {
        "bench": spec.name,
        "run": label,
        "repeat": repeat,
        **step_statistics(ranks[0]["step_times_s"], samples_per_step),
        **gpu_busy(spec.device_type, spec.run.profile_steps, ranks[0]["step_times_s"], ranks[0]["kernel_busy_ms_per_step"]),
        "world_size": spec.run.world_size,
        "global_batch_size": global_batch,
        "warmup_steps": spec.run.warmup_steps,
        "measured_steps": spec.run.measured_steps,
        "threads_per_rank": [rank["threads"] for rank in ranks],
        "peak_memory_per_rank": memory,
        "plan": ranks[0]["plan"],
        "batches_checksum_per_rank": [rank["batches_checksum"] for rank in ranks],
        **({"phases_ms_per_step_rank0": ranks[0]["phases_ms_per_step"]} if ranks[0]["phases_ms_per_step"] else {}),
        **({"embedding_hbm_bandwidth_rank0": ranks[0]["embedding_hbm_bandwidth"]} if ranks[0]["embedding_hbm_bandwidth"] else {}),
        "device": device_description(spec),
        "versions": library_versions(),
        "config": {
            "run": vars(spec.run), **_data_config(spec), "model": {**spec.model, **model_overrides},
            "strategy": {**spec.strategy, **strategy_overrides},
            # The raw loops train in float32, whatever the app does.
            "precision": FLOAT32 if label.startswith("raw") else app_precision(spec.run, overrides),
        },
    }  # fmt: skip


def _data_config(spec: BenchSpec) -> dict[str, Any]:
    """The data settings the run used: the dataset's with what reading it found, or the random data's."""
    if spec.dataset is None:
        return {"data": vars(spec.data)}
    return {"dataset": spec.dataset.settings, "dataset_read": spec.dataset.shape()}


def summary_line(spec: BenchSpec, lines: list[dict[str, Any]]) -> dict[str, Any]:
    """The ratios of each app run over the plain loop (median over repeats of per-repeat ratios), and
    the milliseconds each app step takes beyond the plain loop's (median over repeats of the
    difference of step-time medians: what Lightning adds per step, where the model is small)."""
    by_run: dict[str, list[float]] = {}
    step_ms_by_run: dict[str, list[float]] = {}
    for line in lines:
        by_run.setdefault(line["run"], []).append(line["samples_per_s_median"])
        step_ms_by_run.setdefault(line["run"], []).append(line["step_ms_p50"])
    summary: dict[str, Any] = {"bench": spec.name, "summary": True}
    summary.update({f"{run}_samples_per_s_median": statistics.median(rates) for run, rates in by_run.items()})
    summary.update(_busy_medians(lines))
    for baseline in ("raw", "raw_base"):
        for run, rates in by_run.items():
            if baseline in by_run and not run.startswith("raw"):
                per_repeat = [a / r for a, r in zip(rates, by_run[baseline])]
                key = f"ratio_{run}_over_{baseline}"
                summary[key] = statistics.median(per_repeat)
                summary[f"{key}_per_repeat"] = per_repeat
                extra_ms = [a - r for a, r in zip(step_ms_by_run[run], step_ms_by_run[baseline])]
                summary[f"step_ms_p50_{run}_minus_{baseline}"] = statistics.median(extra_ms)
    # The app as it runs by default against the plain loop; a variant may change the plan on purpose (a
    # table constraint, e.g. UVM caching), so variants are named where theirs differs, not judged.
    compared = [line for line in lines if line["run"] == "app" or line["run"].startswith("raw")] or lines
    plans = {line["plan"] for line in compared}
    summary["same_plan"] = len(plans) == 1
    summary["variants_with_another_plan"] = sorted({line["run"] for line in lines if line["plan"] not in plans})
    summary["same_batches"] = len({tuple(line["batches_checksum_per_rank"]) for line in lines}) == 1
    # The target is the app's: no rank grows by more than 1.1x what it must hold (tables never duplicated).
    growth = {
        run: max(rank["growth_over_expected"] for line in lines if line["run"] == run for rank in line["peak_memory_per_rank"])
        for run in by_run
    }
    summary["memory_growth_over_expected_max"] = growth
    summary["memory_target_factor"] = MEMORY_TARGET_FACTOR
    # Judged on the app as it runs by default; a variant's growth (compile's code and caches) is reported
    # above as a cost of that lever. Without the default run (run.sides), on every app run.
    judged = {"app": growth["app"]} if "app" in growth else {run: g for run, g in growth.items() if not run.startswith("raw")}
    summary["memory_target_holds"] = all(g <= MEMORY_TARGET_FACTOR for g in judged.values())
    return summary


def _busy_medians(lines: list[dict[str, Any]]) -> dict[str, Any]:
    """Per run, the median over repeats of ``gpu_busy_fraction`` and ``host_ms_per_step_outside_kernels``
    (null where a repeat has none: CPU, or no profiled steps; the run lines say why)."""
    medians: dict[str, Any] = {}
    for run in dict.fromkeys(line["run"] for line in lines):
        for field in BUSY_FIELDS:
            values = [line.get(field) for line in lines if line["run"] == run]
            medians[f"{run}_{field}_median"] = None if None in values else statistics.median(values)
    return medians


def device_description(spec: BenchSpec) -> str:
    if spec.device_type == "cuda":
        return f"{spec.run.world_size} x {torch.cuda.get_device_name(0)}"
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())  # fmt: skip
    return f"cpu: {len(os.sched_getaffinity(0))} cores of {model}"


def library_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for package in ("torch", "torchrec", "fbgemm-gpu", "fbgemm-gpu-cpu", "lightning", "jsonargparse"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions
