"""Sharding plan: which embedding table goes to which rank, and how it is split.

TorchRec's planner does the search; this module turns the user's YAML settings into the planner's
``Topology`` and ``ParameterConstraints``, rejects requests the device cannot honour before any work
starts, and renders the resulting plan as a table for the log.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
from torchrec.distributed.planner.types import KernelConfig, ParameterConstraints, TopologyFactory, TrainerConfig
from torchrec.distributed.types import ModuleSharder, ShardingPlan, ShardingType
from torchrec.distributed.utils import optimizer_type_to_emb_opt_type
from fbgemm_gpu.split_embedding_configs import EmbOptimType

# Share of each device's memory the planner keeps free for the dense model, activations and buffers.
STORAGE_RESERVED_FRACTION = 0.15

SHARDING_TYPES: tuple[str, ...] = tuple(t.value for t in ShardingType)


@dataclass
class TableConstraint:
    """Limits the planner's choices for one embedding table.

    Args:
        sharding_types: allowed sharding types, e.g. ``[table_wise, column_wise]``.
        compute_kernels: allowed TorchRec compute kernels, e.g. ``[fused]``.
        min_partition: smallest column-wise shard width (columns).
    """

    sharding_types: list[str] | None = None
    compute_kernels: list[str] | None = None
    min_partition: int | None = None


def default_sharders() -> list[ModuleSharder[nn.Module]]:
    """The sharders the planner may use: our models hold a single EmbeddingBagCollection."""
    return [EmbeddingBagCollectionSharder()]


def supported_sharding_types(device_type: str) -> list[str]:
    """Sharding types TorchRec implements for embedding bags on ``device_type`` ("cpu" or "cuda")."""
    return list(EmbeddingBagCollectionSharder().sharding_types(device_type))


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
    if table_names is not None:
        unknown = sorted(set(table_constraints) - set(table_names))
        if unknown:
            raise ValueError(
                f"strategy.table_constraints names unknown tables {unknown}; tables are {sorted(table_names)}"
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
        if allowed is None and own.compute_kernels is None and own.min_partition is None:
            continue
        constraints[name] = ParameterConstraints(
            sharding_types=list(allowed) if allowed else None,
            compute_kernels=own.compute_kernels,
            min_partition=own.min_partition,
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


def plan_sharding(
    module: nn.Module,
    *,
    world_size: int,
    local_world_size: int,
    device: torch.device,
    sharders: list[ModuleSharder[nn.Module]],
    constraints: dict[str, ParameterConstraints],
    hbm_cap_bytes: int | None,
    ddr_cap_bytes: int | None,
    batch_size_per_rank: int | None,
    process_group: dist.ProcessGroup,
) -> ShardingPlan:
    """Plans on rank 0 and broadcasts, so every rank shards identically (TorchRec's collective_plan)."""
    topology = TopologyFactory.create_topology(
        TrainerConfig(
            world_size=world_size,
            local_world_size=local_world_size,
            hbm_cap_bytes=hbm_cap_bytes,
            ddr_cap_bytes=ddr_cap_bytes,
        ),
        # ROCm GPUs report "cuda" too, which is what the planner expects.
        kernel_config=KernelConfig(compute_device=device.type),
    )
    planner = EmbeddingShardingPlanner(
        topology=topology,
        batch_size=batch_size_per_rank,
        constraints=constraints,
        # TorchRec's default (heuristical) reservation estimates the dense part from tensors that are
        # not materialised yet and warns about it; a fixed share of each device's memory does not.
        storage_reservation=FixedPercentageStorageReservation(percentage=STORAGE_RESERVED_FRACTION),
    )
    return planner.collective_plan(module, sharders, process_group)


def _natural_key(name: str) -> list[int | str]:
    """Sorts t_cat_2 before t_cat_10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def format_plan(plan: ShardingPlan) -> str:
    """The plan as an aligned text table: one row per table, with its sharding type, kernel and shards."""
    rows = [("table", "sharding", "kernel", "ranks", "shard sizes (rows x cols)")]
    for _, module_plan in sorted(plan.plan.items()):
        for param_name, sharding in sorted(module_plan.items(), key=lambda item: _natural_key(item[0])):  # type: ignore[union-attr]
            shards = sharding.sharding_spec.shards if sharding.sharding_spec is not None else []
            sizes = " ".join("x".join(str(s) for s in shard.shard_sizes) for shard in shards) or "replicated"
            ranks = ",".join(str(r) for r in sharding.ranks) if sharding.ranks else "all"
            rows.append((param_name, sharding.sharding_type, sharding.compute_kernel, ranks, sizes))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)
