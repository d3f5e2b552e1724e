"""Sharding plan: which embedding table goes to which rank, and how it is split.

TorchRec's planner does the search; this module turns the user's YAML settings into the planner's
``Topology`` and ``ParameterConstraints``, rejects requests the device cannot honour before any work
starts, and renders the resulting plan as a table for the log.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.planner.constants import BATCH_SIZE, UVM_CACHING_RATIO
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.perf_models import NoopPerfModel, NoopStorageModel
from torchrec.distributed.planner.stats import EmbeddingStats
from torchrec.distributed.planner.types import (
    ParameterConstraints,
    PlannerError,
    PlannerErrorType,
    ShardingOption,
    Stats,
    Topology,
)
from torchrec.distributed.types import CacheParams, ModuleSharder, ParameterSharding, ShardingPlan, ShardingType
from torchrec.distributed.utils import optimizer_type_to_emb_opt_type
from fbgemm_gpu.split_embedding_configs import EmbOptimType

from app.compat import create_topology
from app.distributed.hbm_budget import (
    MemoryBudget,
    format_bytes,
    least_hbm_over_ranks,
    memory_budget,
    describe_memory_budget,
    storage_reservation,
)
from app.distributed.topology import DeviceTopology

SHARDING_TYPES: tuple[str, ...] = tuple(t.value for t in ShardingType)
COMPUTE_KERNELS: tuple[str, ...] = tuple(k.value for k in EmbeddingComputeKernel)
# The kernel that keeps a table in host memory behind an HBM cache of cache_load_factor x its rows.
UVM_CACHING_KERNEL = EmbeddingComputeKernel.FUSED_UVM_CACHING.value


@dataclass
class TableConstraint:
    """Limits the planner's choices for one embedding table.

    Args:
        sharding_types: allowed sharding types, e.g. ``[table_wise, column_wise]``.
        compute_kernels: allowed TorchRec compute kernels, e.g. ``[fused]``.
        min_partition: smallest column-wise shard width (columns).
        cache_load_factor: for the ``fused_uvm_caching`` kernel (GPUs), the share of the table's rows its
            HBM cache holds, in (0, 1] (TorchRec's ``CacheParams.load_factor``; default 0.2, FBGEMM's and
            the planner's).
    """

    sharding_types: list[str] | None = None
    compute_kernels: list[str] | None = None
    min_partition: int | None = None
    cache_load_factor: float | None = None


def as_table_constraints(constraints: Mapping[str, TableConstraint | Mapping[str, Any]] | None) -> dict[str, TableConstraint]:
    """Each table's constraint as a ``TableConstraint``: jsonargparse builds them from the CLI and configs,
    a caller in Python or the bench's JSON may give a plain mapping of its fields. An unknown field is
    refused naming the setting (``strategy.table_constraints.<table>``)."""
    typed = {}
    for name, constraint in (constraints or {}).items():
        if isinstance(constraint, Mapping):
            unknown = sorted(set(constraint) - set(TableConstraint.__dataclass_fields__))
            if unknown:
                raise ValueError(
                    f"strategy.table_constraints.{name}: unknown field(s) {unknown}; "
                    f"fields: {', '.join(TableConstraint.__dataclass_fields__)}"
                )
            constraint = TableConstraint(**constraint)
        typed[name] = constraint
    return typed


def keeps_rows_in_host_memory(compute_kernel: str) -> bool:
    """Whether a TorchRec compute kernel keeps the table's rows in host memory, read over UVM
    (``fused_uvm``, and ``fused_uvm_caching`` behind an HBM cache)."""
    return "uvm" in compute_kernel


def cache_load_factor(sharding: ParameterSharding) -> float:
    """The share of a ``fused_uvm_caching`` table's rows its HBM cache holds: the plan's, else the
    planner's and FBGEMM's default."""
    cache = sharding.cache_params
    return cache.load_factor if cache is not None and cache.load_factor else UVM_CACHING_RATIO


def default_sharders() -> list[ModuleSharder[nn.Module]]:
    """The sharders the planner may use: our models hold a single EmbeddingBagCollection."""
    return [EmbeddingBagCollectionSharder()]


def supported_sharding_types(device_type: str) -> list[str]:
    """Sharding types TorchRec implements for embedding bags on ``device_type`` ("cpu" or "cuda")."""
    return list(EmbeddingBagCollectionSharder().sharding_types(device_type))


def supported_compute_kernels(device_type: str) -> list[str]:
    """Compute kernels TorchRec's sharder offers for embedding bags on ``device_type``, over all sharding types
    (on CPU ``fused`` and ``dense``; GPUs add the UVM and key-value kernels)."""
    sharder = EmbeddingBagCollectionSharder()
    kernels = [k for t in sharder.sharding_types(device_type) for k in sharder.compute_kernels(t, device_type)]
    return list(dict.fromkeys(kernels))


def validate_sharding_request(
    sharding_types: Sequence[str] | None,
    table_constraints: Mapping[str, TableConstraint],
    device_type: str,
    table_names: Iterable[str] | None = None,
) -> None:
    """Raises a ValueError naming the setting when a request cannot be planned on ``device_type``.

    Without this check the planner fails much later, on every rank, with a search error that
    does not say which setting caused it.
    """
    supported = supported_sharding_types(device_type)
    requests = [("strategy.sharding_types", sharding_types or [])]
    requests += [
        (f"strategy.table_constraints.{name}.sharding_types", c.sharding_types or [])
        for name, c in table_constraints.items()
    ]
    for setting, types in requests:
        for sharding_type in types:
            if sharding_type not in SHARDING_TYPES:
                raise ValueError(
                    f"{setting}: unknown sharding type {sharding_type!r}; known: {', '.join(SHARDING_TYPES)}"
                )
            if sharding_type not in supported:
                raise ValueError(
                    f"{setting}: {sharding_type!r} is not available on {device_type} "
                    f"(TorchRec supports {', '.join(supported)} there)"
                )
    for name, constraint in table_constraints.items():
        validate_table_kernels(f"strategy.table_constraints.{name}", constraint, device_type)
    if table_names is not None:
        unknown = sorted(set(table_constraints) - set(table_names))
        if unknown:
            raise ValueError(
                f"strategy.table_constraints names unknown tables {unknown}; tables are {sorted(table_names)}"
            )


def validate_table_kernels(setting: str, constraint: TableConstraint, device_type: str) -> None:
    """Raises a ValueError naming ``setting`` for a compute kernel unknown or absent on ``device_type``, or a
    ``cache_load_factor`` out of (0, 1] or for a table that cannot get the UVM caching kernel."""
    supported = supported_compute_kernels(device_type)
    for kernel in constraint.compute_kernels or []:
        if kernel not in COMPUTE_KERNELS:
            raise ValueError(f"{setting}.compute_kernels: unknown kernel {kernel!r}; known: {', '.join(COMPUTE_KERNELS)}")
        if kernel not in supported:
            raise ValueError(
                f"{setting}.compute_kernels: {kernel!r} is not available on {device_type} (TorchRec offers "
                f"{', '.join(supported)} there); tables in host memory (fused_uvm, fused_uvm_caching) need GPUs"
            )
    factor = constraint.cache_load_factor
    if factor is None:
        return
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise ValueError(
            f"{setting}.cache_load_factor = {factor!r}: expected the share of the table's rows cached in HBM, in (0, 1]"
        )
    if UVM_CACHING_KERNEL not in supported:
        raise ValueError(
            f"{setting}.cache_load_factor = {factor}: the UVM caching kernel (fused_uvm_caching) it sizes is not "
            f"available on {device_type}; remove the setting or train on GPUs"
        )
    if constraint.compute_kernels is not None and UVM_CACHING_KERNEL not in constraint.compute_kernels:
        raise ValueError(
            f"{setting}.cache_load_factor = {factor}: applies to the fused_uvm_caching kernel only, which "
            f"{setting}.compute_kernels = {constraint.compute_kernels} leaves out"
        )


# Optimizers FBGEMM's CPU embedding kernels implement (its GPU kernels add Adam, LAMB and others).
_CPU_FUSED_OPTIMIZERS = frozenset(
    {EmbOptimType.EXACT_ADAGRAD, EmbOptimType.EXACT_ROWWISE_ADAGRAD, EmbOptimType.EXACT_SGD}
)


def validate_fused_optimizer(module: nn.Module, device_type: str) -> None:
    """Raises a ValueError naming the setting when the tables' fused optimizer has no kernel on the device."""
    if device_type != "cpu":
        return
    for parameter in module.parameters():
        for optimizer_class in getattr(parameter, "_optimizer_classes", []):
            if optimizer_type_to_emb_opt_type(optimizer_class) not in _CPU_FUSED_OPTIMIZERS:
                raise ValueError(
                    f"model.sparse_optimizer: {optimizer_class.__name__} has no CPU embedding kernel in FBGEMM; "
                    "on CPU use row_wise_adagrad, adagrad or sgd"
                )


def build_constraints(
    table_names: Iterable[str],
    sharding_types: Sequence[str] | None,
    table_constraints: Mapping[str, TableConstraint],
) -> dict[str, ParameterConstraints]:
    """Per-table planner constraints: a table's own setting wins over the global ``sharding_types``."""
    constraints = {}
    for name in table_names:
        own = table_constraints.get(name, TableConstraint())
        allowed = own.sharding_types or sharding_types
        cached = own.cache_load_factor is not None
        if allowed is None and own.compute_kernels is None and own.min_partition is None and not cached:
            continue
        constraints[name] = ParameterConstraints(
            sharding_types=list(allowed) if allowed else None,
            compute_kernels=own.compute_kernels,
            min_partition=own.min_partition,
            cache_params=CacheParams(load_factor=float(own.cache_load_factor)) if cached else None,
        )
    return constraints


def embedding_table_names(module: nn.Module) -> list[str]:
    """Names of all EmbeddingBagCollection tables in ``module`` (unsharded)."""
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    return [
        config.name
        for sub in module.modules()
        if isinstance(sub, EmbeddingBagCollection)
        for config in sub.embedding_bag_configs()
    ]


PLANNER_OBJECTIVES = ("performance", "memory")
_PRECISIONS = {torch.float32: "fp32", torch.float16: "fp16"}


@dataclass
class ShardEstimate:
    """The planner's estimate for one shard of the plan it chose (sizes in bytes, times in ms per step)."""

    table: str
    sharding_type: str
    compute_kernel: str
    rank: int
    offsets: list[int]
    sizes: list[int]
    hbm_bytes: int
    ddr_bytes: int
    fwd_compute_ms: float
    fwd_comms_ms: float
    bwd_compute_ms: float
    bwd_comms_ms: float
    total_ms: float  # as TorchRec's performance model counts it (with prefetch and input distribution)
    precision: str = "fp32"  # of the table's weights: fp32 or fp16 (model.embedding_precision)
    cache_load_factor: float | None = None  # the HBM cache's share of the rows, for fused_uvm_caching only


@dataclass
class PlannedSharding:
    """A sharding plan with what the planner estimated for each shard (empty for a plan it did not make),
    the device figures it planned for and the memory it left to the tables (None for a plan it did not make)."""

    plan: ShardingPlan
    estimates: list[ShardEstimate]
    topology: DeviceTopology | None = None
    memory_budget: MemoryBudget | None = None


class _BestPlanRecorder(Stats):
    """Keeps the sharding options of the plan the planner chose: TorchRec hands them only to its Stats."""

    def __init__(self) -> None:
        self.best_plan: list[ShardingOption] = []

    def log(self, *args: Any, best_plan: list[ShardingOption] | None = None, **kwargs: Any) -> None:
        self.best_plan = list(best_plan or [])


def build_topology(device: DeviceTopology, *, world_size: int, local_world_size: int) -> Topology:
    """TorchRec's Topology for ``world_size`` devices like ``device``, ``local_world_size`` of them per node."""
    return create_topology(world_size=world_size, local_world_size=local_world_size, **device.to_torchrec_kwargs())


def plan_on_this_process(
    module: nn.Module,
    *,
    topology: Topology,
    sharders: list[ModuleSharder[nn.Module]],
    constraints: dict[str, ParameterConstraints],
    batch_size_per_rank: int | None,
    objective: str = "performance",
    hbm_reserved_fraction: float = DeviceTopology.hbm_reserved_fraction,
    hbm_reserved_bytes: int = DeviceTopology.hbm_reserved_bytes,
) -> PlannedSharding:
    """Runs TorchRec's planner here; a model that cannot fit raises a ValueError naming the table and the shortfall.

    ``objective``: ``performance`` picks the plan with the lowest estimated step time (TorchRec's
    default ``NoopPerfModel``), ``memory`` the one with the lowest peak HBM per device (its
    ``NoopStorageModel``). The planner fills what ``storage_reservation`` leaves of each device.
    """
    if objective not in PLANNER_OBJECTIVES:
        raise ValueError(f"strategy.planner_objective = {objective!r}: choose one of {', '.join(PLANNER_OBJECTIVES)}")
    reserve = dict(hbm_reserved_fraction=hbm_reserved_fraction, hbm_reserved_bytes=hbm_reserved_bytes)
    recorder = _BestPlanRecorder()
    performance_model = NoopStorageModel(topology) if objective == "memory" else NoopPerfModel(topology)
    planner = EmbeddingShardingPlanner(
        topology=topology,
        batch_size=batch_size_per_rank,
        constraints=constraints,
        storage_reservation=storage_reservation(module, sharders, compute_device=topology.compute_device, **reserve),
        performance_model=performance_model,
        stats=[EmbeddingStats(), recorder],
    )
    batch_size = batch_size_per_rank or BATCH_SIZE
    try:
        budget = memory_budget(topology, module, sharders, constraints, batch_size, **reserve)
        plan = planner.plan(module, sharders)
    except PlannerError as error:
        # A table too big for any one device is a "strict constraints" failure to TorchRec when the
        # devices together could hold it, an "insufficient storage" one when they could not (or when
        # the reservation alone exceeds a device).
        explained = None
        if error.error_type in (PlannerErrorType.INSUFFICIENT_STORAGE, PlannerErrorType.STRICT_CONSTRAINTS):
            explained = explain_shortfall(
                module, topology=topology, sharders=sharders, constraints=constraints,
                batch_size_per_rank=batch_size_per_rank,
                whole_model=error.error_type == PlannerErrorType.INSUFFICIENT_STORAGE, **reserve,
            )  # fmt: skip
        raise ValueError(explained or f"TorchRec's planner found no plan: {error}") from error
    estimates = [estimate for option in recorder.best_plan for estimate in _estimates(option)]
    return PlannedSharding(plan, estimates, memory_budget=budget)


def _estimates(option: ShardingOption) -> list[ShardEstimate]:
    # The planner sizes a cache it is given no load factor for at UVM_CACHING_RATIO, as FBGEMM's TBE
    # does by default (cache_load_factor=0.2), so that is the figure the estimates stand for.
    cache_load_factor = None
    if option.compute_kernel == UVM_CACHING_KERNEL:
        cache_load_factor = option.cache_load_factor or UVM_CACHING_RATIO
    precision = _PRECISIONS.get(option.tensor.dtype, str(option.tensor.dtype).removeprefix("torch."))
    estimates = []
    for shard in option.shards:
        storage, perf = shard.storage, shard.perf
        estimates.append(
            ShardEstimate(
                table=option.name,
                sharding_type=option.sharding_type,
                compute_kernel=option.compute_kernel,
                rank=-1 if shard.rank is None else int(shard.rank),
                offsets=[int(o) for o in shard.offset],
                sizes=[int(s) for s in shard.size],
                hbm_bytes=int(storage.hbm) if storage else 0,
                ddr_bytes=int(storage.ddr) if storage else 0,
                fwd_compute_ms=float(perf.fwd_compute) if perf else 0.0,
                fwd_comms_ms=float(perf.fwd_comms) if perf else 0.0,
                bwd_compute_ms=float(perf.bwd_compute) if perf else 0.0,
                bwd_comms_ms=float(perf.bwd_comms) if perf else 0.0,
                total_ms=float(perf.total) if perf else 0.0,
                precision=precision,
                cache_load_factor=cache_load_factor,
            )
        )
    return estimates


def explain_shortfall(
    module: nn.Module,
    *,
    topology: Topology,
    sharders: list[ModuleSharder[nn.Module]],
    constraints: dict[str, ParameterConstraints],
    batch_size_per_rank: int | None,
    whole_model: bool = True,
    hbm_reserved_fraction: float = DeviceTopology.hbm_reserved_fraction,
    hbm_reserved_bytes: int = DeviceTopology.hbm_reserved_bytes,
) -> str | None:
    """Why no plan fits: the reservation alone exceeds a device, or the tables that fit on no device in
    any allowed way and by how much, or else (with ``whole_model``) the total the tables need against
    what all devices have; None if none applies.

    TorchRec's PlannerError reports the storage gap of the whole model only; this enumerates the same
    options the planner had and keeps, per table, the one that comes closest to fitting on one device.
    """
    batch_size = batch_size_per_rank or BATCH_SIZE
    reservation = storage_reservation(
        module, sharders, compute_device=topology.compute_device,
        hbm_reserved_fraction=hbm_reserved_fraction, hbm_reserved_bytes=hbm_reserved_bytes,
    )  # fmt: skip
    try:
        available = reservation.reserve(topology, batch_size, module, sharders, constraints)
    except PlannerError:
        budget_if_empty = memory_budget(
            topology, module, sharders, constraints, batch_size, hbm_reserved_fraction=0.0, hbm_reserved_bytes=0
        )
        return (
            f"the model does not fit: before any table, each device needs {format_bytes(budget_if_empty.dense_bytes)} for the "
            f"dense part in training and {format_bytes(budget_if_empty.inputs_bytes)} for the pipeline's sparse inputs, plus "
            f"strategy.topology_overrides.hbm_reserved_fraction = {hbm_reserved_fraction} and hbm_reserved_bytes = "
            f"{hbm_reserved_bytes}, more than its {format_bytes(budget_if_empty.capacity_bytes)} of HBM"
        )
    hbm_free = min(device.storage.hbm for device in available.devices)
    ddr_free = min(device.storage.ddr for device in available.devices)
    options = EmbeddingEnumerator(topology=topology, batch_size=batch_size, constraints=constraints).enumerate(
        module, sharders
    )
    tier = "HBM" if topology.compute_device != "cpu" else "host memory"
    shortfalls: dict[str, int] = {}
    smallest: dict[str, int] = {}
    for option in options:
        largest_shard = max(option.shards, key=lambda shard: shard.storage.hbm + shard.storage.ddr).storage
        excess = max(0, largest_shard.hbm - hbm_free) + max(0, largest_shard.ddr - ddr_free)
        shortfalls[option.name] = min(excess, shortfalls.get(option.name, excess))
        total = sum(shard.storage.hbm if tier == "HBM" else shard.storage.ddr for shard in option.shards)
        smallest[option.name] = min(total, smallest.get(option.name, total))
    per_device = hbm_free if tier == "HBM" else ddr_free
    free = f"{format_bytes(ddr_free)} of host memory"
    if tier == "HBM":
        free = f"{format_bytes(hbm_free)} of HBM and {free}"
    reserved = (
        "what the planner may fill: the capacity less strategy.topology_overrides.hbm_reserved_fraction, "
        "the dense part in training and the pipeline's inputs"
    )
    too_big = {name: gap for name, gap in shortfalls.items() if gap > 0}
    if too_big:
        lines = [f"  {name}: short by {format_bytes(gap)} per device" for name, gap in sorted(too_big.items(), key=_by_gap)]
        return (
            f"the model does not fit: {len(too_big)} table(s) fit on no device in any allowed sharding "
            f"({free} per device, {reserved}):\n"
            + "\n".join(lines)
            + "\nraise strategy.topology_overrides (hbm_cap_bytes / ddr_cap_bytes), allow more sharding types, "
            "use more devices or smaller tables"
        )
    if not whole_model:
        return None
    need = sum(smallest.values())
    have = per_device * topology.world_size
    largest = ", ".join(f"{name} {format_bytes(size)}" for name, size in sorted(smallest.items(), key=_by_gap)[:3])
    return (
        f"the model does not fit: its tables need at least {format_bytes(need)} of {tier} in all, the "
        f"{topology.world_size} devices have {format_bytes(have)} free ({reserved}): short by {format_bytes(max(need - have, 0))} "
        f"or more (largest tables: {largest})"
    )


def _by_gap(item: tuple[str, int]) -> tuple[int, list[int | str]]:
    return (-item[1], natural_key(item[0]))


def plan_sharding(
    module: nn.Module,
    *,
    device: DeviceTopology,
    world_size: int,
    local_world_size: int,
    sharders: list[ModuleSharder[nn.Module]],
    constraints: dict[str, ParameterConstraints],
    batch_size_per_rank: int | None,
    objective: str,
    process_group: dist.ProcessGroup,
) -> PlannedSharding:
    """Plans on rank 0 for the least HBM any rank has, and broadcasts the plan, or the reason there is
    none, to every rank; warns when the plan keeps tables in host memory.

    TorchRec's ``collective_plan`` does the same but leaves the other ranks waiting in the broadcast
    forever when the planner fails on rank 0; here every rank raises the same error.
    """
    device = least_hbm_over_ranks(device, process_group)
    outcome: list[Any] = [None]
    if dist.get_rank(process_group) == 0:
        try:
            topology = build_topology(device, world_size=world_size, local_world_size=local_world_size)
            outcome[0] = plan_on_this_process(
                module, topology=topology, sharders=sharders, constraints=constraints,
                batch_size_per_rank=batch_size_per_rank, objective=objective,
                hbm_reserved_fraction=device.hbm_reserved_fraction, hbm_reserved_bytes=device.hbm_reserved_bytes,
            )  # fmt: skip
            outcome[0].topology = device
        except Exception as error:  # noqa: BLE001 - re-raised on every rank below
            outcome[0] = f"{type(error).__name__}: {error}" if not isinstance(error, ValueError) else str(error)
    dist.broadcast_object_list(outcome, src=dist.get_global_rank(process_group, 0), group=process_group)
    if isinstance(outcome[0], str):
        raise ValueError(f"sharding plan: {outcome[0]}")
    planned: PlannedSharding = outcome[0]
    if planned.memory_budget is not None:
        rank_zero_info(describe_memory_budget(planned.memory_budget, device))
    warning = host_memory_warning(planned)
    if warning:
        rank_zero_warn(warning)
    return planned


def host_memory_tables(plan: ShardingPlan) -> dict[str, str]:
    """Tables the plan gives a UVM kernel (``fused_uvm``: rows in host memory, read by the GPU over PCIe;
    ``fused_uvm_caching``: the same behind an HBM cache), with their kernel."""
    return {
        name: sharding.compute_kernel
        for module_plan in plan.plan.values()
        for name, sharding in module_plan.items()  # type: ignore[union-attr]
        if keeps_rows_in_host_memory(sharding.compute_kernel)
    }


def host_memory_warning(planned: PlannedSharding) -> str | None:
    """A warning naming the tables the plan keeps in host memory and how much, or None when there are none.

    TorchRec's planner may choose a UVM kernel on GPUs whenever the sharder offers it (it does unless
    ``table_constraints`` limit ``compute_kernels``): ``planner_objective: memory`` prefers it because it
    uses the least HBM, and ``performance`` takes it when the tables do not fit in HBM otherwise.
    Such a table is read over PCIe every step: tens of times slower than HBM.
    """
    tables = host_memory_tables(planned.plan)
    if not tables:
        return None
    details: dict[str, list[str]] = {name: [kernel] for name, kernel in tables.items()}
    host_bytes: dict[str, int] = {}
    for estimate in planned.estimates:
        host_bytes[estimate.table] = host_bytes.get(estimate.table, 0) + estimate.ddr_bytes
        if estimate.cache_load_factor is not None and len(details.get(estimate.table, [])) == 1:
            details[estimate.table].append(f"an HBM cache of {estimate.cache_load_factor:g} of its rows")
    for name, num_bytes in host_bytes.items():
        if name in details:
            details[name].append(f"{format_bytes(num_bytes)} of host memory")
    listed = ", ".join(
        f"{name} ({', '.join(details[name])})" for name in sorted(tables, key=natural_key)
    )
    return (
        f"sharding plan: {len(tables)} table(s) live in host memory, read by the GPU over PCIe through UVM: {listed}. "
        "They train much slower than tables in HBM. To keep every table in HBM use more GPUs, smaller tables, "
        "model.embedding_precision = fp16 (half the bytes per row), strategy.planner_objective = performance, "
        "or strategy.table_constraints.<table>.compute_kernels: [fused] (then a table that does not fit is "
        "refused with its shortfall)"
    )


def natural_key(name: str) -> list[int | str]:
    """Sorts t_cat_2 before t_cat_10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def format_plan(plan: ShardingPlan) -> str:
    """The plan as an aligned text table: one row per table, with its sharding type, kernel and shards."""
    rows = [("table", "sharding", "kernel", "ranks", "shard sizes (rows x cols)")]
    for _, module_plan in sorted(plan.plan.items()):
        for param_name, sharding in sorted(module_plan.items(), key=lambda item: natural_key(item[0])):  # type: ignore[union-attr]
            shards = sharding.sharding_spec.shards if sharding.sharding_spec is not None else []
            sizes = " ".join("x".join(str(s) for s in shard.shard_sizes) for shard in shards) or "replicated"
            ranks = ",".join(str(r) for r in sharding.ranks) if sharding.ranks else "all"
            rows.append((param_name, sharding.sharding_type, sharding.compute_kernel, ranks, sizes))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)
