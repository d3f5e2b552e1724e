"""What a benchmark runs, and the checks that refuse a configuration before any process starts."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from app.bench.data import RandomData
from app.bench.dataset import DatasetInput
from app.distributed.strategy import APPLIED_PRECISIONS
from app.distributed.sharding import as_table_constraints, validate_fused_optimizer, validate_sharding_request
from app.model.compile import DEFAULT_MODE, check_compile_mode, check_compile_supported
from app.model.dlrm import build_embedding_bag_collection, validate_dlrm_sizes
from app.train.metrics import available_host_bytes
from app.train.optimizers import fuse_sparse_optimizer
from app.train.precision import FLOAT32, check_precision_supported, default_precision

Side = Literal["app", "raw", "raw_base"]

# The key of an app variant that holds strategy settings (``trainer.strategy.init_args.*``); its other keys are model settings.
STRATEGY_KEY = "strategy"
# The key of an app variant that sets the app's ``trainer.precision`` (e.g. ``{precision: 32-true}``).
PRECISION_KEY = "precision"
# The key of an app variant that adds the app's progress bar, redrawn every N batches (``python -m app``'s:
# ``app.cli.PROGRESS_BAR_REFRESH_STEPS``); without it the app side runs without a bar.
PROGRESS_BAR_KEY = "progress_bar_refresh_rate"
_TRAINER_KEYS = (STRATEGY_KEY, PRECISION_KEY, PROGRESS_BAR_KEY)

# Optimizer state the fused embedding optimizers keep per table element (row-wise Adagrad: per row).
_STATE_PER_ELEMENT = {"adagrad": 1.0, "adam": 2.0, "sgd": 0.0, "row_wise_adagrad": 0.0}


@dataclass
class RunSettings:
    """How the benchmark runs.

    Args:
        world_size: processes (one per GPU with ``accelerator: gpu``), all on this machine.
        accelerator: ``cpu`` (gloo) or ``gpu`` (nccl).
        precision: the app's ``trainer.precision`` (``32-true`` or ``bf16-mixed``); unset, the app's own default
            on this machine (``bf16-mixed`` on a CPU with bf16 matrix units, app/train/precision.py). The plain
            loop trains in float32.
        warmup_steps: steps trained before the clock starts (start-up, first-touch memory, allocator warm-up).
        measured_steps: steps whose times are reported.
        repeats: app/raw pairs, run one after the other, alternating which side goes first.
        sides: which sides run: ``app``; ``raw``, the plain TorchRec loop around TrainPipelineSparseDist
            (the baseline of ``ratio_app_over_raw``); ``raw_base``, the same loop around TorchRec's
            TrainPipelineBase, which overlaps nothing (gives ``ratio_app_over_raw_base``).
        seed: seed of the model initialisation and of the random data (plus the rank); a dataset
            shuffles with its own dataset.seed.
        profile_steps: after the measured steps, this many more under the PyTorch profiler on rank 0:
            a trace per run in ``output_dir`` (TensorBoard/Perfetto) and a table of ms per step and phase.
        output_dir: where profiler traces and the app's record of its sharding plan go.
    """

    world_size: int = 2
    accelerator: Literal["cpu", "gpu"] = "cpu"
    precision: str | None = None
    warmup_steps: int = 20
    measured_steps: int = 100
    repeats: int = 1
    sides: list[Side] = field(default_factory=lambda: ["app", "raw"])
    seed: int = 0
    profile_steps: int = 0
    output_dir: str = "runs/bench"


@dataclass
class BenchSpec:
    """Everything one run needs, passed to every worker process."""

    name: str
    run: RunSettings
    data: RandomData
    model: dict[str, Any]
    strategy: dict[str, Any]
    app_variants: dict[str, dict[str, Any]]
    dataset: DatasetInput | None = None  # replaces the random data when given

    @property
    def inputs(self) -> RandomData | DatasetInput:
        """What both sides train on: the dataset when one is given, else the random batches."""
        return self.dataset if self.dataset is not None else self.data

    @property
    def planner_batch_size(self) -> int | None:
        """The batch size the app's strategy gives the planner (its data module's ``batch_size``; the
        random data module has none), which the plain loop must give it too for the same plan."""
        return None if self.dataset is None else self.dataset.batch_size_per_rank

    @property
    def total_steps(self) -> int:
        return self.run.warmup_steps + self.run.measured_steps + self.run.profile_steps

    @property
    def device_type(self) -> str:
        return "cpu" if self.run.accelerator == "cpu" else "cuda"

    def model_args(self) -> dict[str, Any]:
        """DLRMModule's arguments, table sizes from the data (random or read)."""
        return {**self.model, "num_embeddings_per_feature": self.inputs.table_rows()}


def check_can_run(spec: BenchSpec) -> None:
    """Raises a ValueError naming the setting for a configuration that cannot run here."""
    check_run_settings(spec.run)
    _check_precision_on_device("run.precision", app_precision(spec.run, {}), spec.device_type)
    rows = spec.inputs.table_rows()
    if spec.dataset is None:
        spec.data.pooling_factors()  # raises for a malformed data.ids_per_lookup
    model = spec.model_args()
    validate_dlrm_sizes(model["interaction"], model["embedding_dim"], model["dense_arch_layer_sizes"], model["over_arch_layer_sizes"])
    _check_compile("model.", model, spec.device_type)
    _check_sharding_request(spec.strategy, spec.device_type)
    tables = build_embedding_bag_collection(model["embedding_dim"], rows, "meta")
    fuse_sparse_optimizer(tables.parameters(), model["sparse_optimizer"], model["sparse_learning_rate"])
    validate_fused_optimizer(tables, spec.device_type)
    _check_tables_fit(spec, rows, model["embedding_dim"], model["sparse_optimizer"])
    for label, overrides in spec.app_variants.items():
        for key in overrides:
            if key not in spec.model and key not in _TRAINER_KEYS:
                raise ValueError(
                    f"app_variants.{label}.{key} is neither a model setting nor one of {', '.join(_TRAINER_KEYS)}; "
                    f"model settings: {', '.join(spec.model)}"
                )
        _check_precision(f"app_variants.{label}.{PRECISION_KEY}", overrides.get(PRECISION_KEY))
        _check_precision_on_device(f"app_variants.{label}.{PRECISION_KEY}", app_precision(spec.run, overrides), spec.device_type)
        refresh_rate = overrides.get(PROGRESS_BAR_KEY, 0)
        if not isinstance(refresh_rate, int) or isinstance(refresh_rate, bool) or refresh_rate < 0:
            raise ValueError(f"app_variants.{label}.{PROGRESS_BAR_KEY} = {refresh_rate!r}: give a whole number of batches, 0 for no bar")
        variant_model, variant_strategy = split_variant(overrides)
        _check_compile(f"app_variants.{label}.", {**spec.model, **variant_model}, spec.device_type)
        if variant_strategy:
            try:
                _check_sharding_request({**spec.strategy, **variant_strategy}, spec.device_type)
            except ValueError as error:
                raise ValueError(f"app_variants.{label}.{error}") from None
        for key in overrides.get(STRATEGY_KEY) or {}:
            if key not in spec.strategy:
                raise ValueError(
                    f"app_variants.{label}.{STRATEGY_KEY}.{key} is not a strategy setting; strategy settings: {', '.join(spec.strategy)}"
                )


def _check_sharding_request(strategy: dict[str, Any], device_type: str) -> None:
    """The strategy's sharding types and table constraints, refused naming the setting (``strategy.*``)."""
    validate_sharding_request(strategy.get("sharding_types"), as_table_constraints(strategy.get("table_constraints")), device_type)


def _check_compile(prefix: str, model: dict[str, Any], device_type: str) -> None:
    """The module's own compile checks (its mode, a compiler here, CUDA graphs on a GPU only), before any process
    starts; ``prefix`` names where the settings came from (``app_variants.NAME.``)."""
    try:
        check_compile_mode(model.get("compile_mode", DEFAULT_MODE), bool(model.get("compile")))
        if model.get("compile"):
            check_compile_supported(device_type, model.get("compile_mode", DEFAULT_MODE))
    except ValueError as error:
        raise ValueError(f"{prefix}{str(error).removeprefix('model.')}") from None


def _check_precision(setting: str, precision: str | None) -> None:
    """The app's strategy applies only these precisions (it refuses the others once its workers run)."""
    if precision is not None and precision not in APPLIED_PRECISIONS:
        raise ValueError(f"{setting} = {precision}: the app applies {' or '.join(APPLIED_PRECISIONS)}")


def _check_precision_on_device(setting: str, precision: str, device_type: str) -> None:
    """bf16 on a GPU without bf16 (app/train/precision.py), refused naming the bench's own setting."""
    try:
        check_precision_supported(precision, device_type)
    except ValueError as error:
        raise ValueError(f"{setting}{str(error).removeprefix('trainer.precision')}") from None


def split_variant(overrides: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A variant's (model settings, strategy settings): the strategy's under its ``strategy`` key (its
    trainer settings are read by ``app_precision`` and the app side: ``precision``, ``progress_bar_refresh_rate``)."""
    model = {key: value for key, value in overrides.items() if key not in _TRAINER_KEYS}
    return model, dict(overrides.get(STRATEGY_KEY) or {})


def app_precision(run: RunSettings, overrides: dict[str, Any]) -> str:
    """The app's ``trainer.precision`` in a run: the variant's, else ``run.precision``, else the app's default
    on this machine, as ``python -m app`` chooses it (app/train/precision.py)."""
    chosen = overrides.get(PRECISION_KEY) or run.precision
    return chosen or default_precision(run.accelerator)[0] or FLOAT32


def check_run_settings(run: RunSettings) -> None:
    """Raises a ValueError naming the ``run.*`` setting that cannot run here."""
    _check_precision("run.precision", run.precision)
    for name in ("world_size", "warmup_steps", "measured_steps", "repeats"):
        if getattr(run, name) < 1:
            raise ValueError(f"run.{name} = {getattr(run, name)} must be at least 1")
    if run.accelerator == "gpu" and torch.cuda.device_count() < run.world_size:
        raise ValueError(f"run.accelerator = gpu with run.world_size = {run.world_size}: {torch.cuda.device_count()} GPUs visible")


def _check_tables_fit(spec: BenchSpec, rows: list[int], embedding_dim: int, sparse_optimizer: str) -> None:
    """Tables and their optimizer state must fit in this machine's memory (GPUs: in theirs, together)."""
    bytes_per_element = 4 * (1 + _STATE_PER_ELEMENT[sparse_optimizer])
    needed = sum(rows) * embedding_dim * bytes_per_element
    if spec.device_type == "cuda":
        available = sum(torch.cuda.get_device_properties(i).total_memory for i in range(spec.run.world_size))
        where = f"{spec.run.world_size} GPUs"
    else:
        # MemAvailable (free + reclaimable page cache), not the free pages alone: after reading or
        # writing a few GB of files the page cache holds most of the memory, and would refuse a bench
        # that fits.
        available = available_host_bytes() or os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        where = "available host memory"
    if needed > available:
        raise ValueError(
            f"{spec.inputs.table_setting()}: the tables with their {sparse_optimizer} state need "
            f"{needed / 2**30:.1f} GiB, more than the {available / 2**30:.1f} GiB of {where}"
        )
