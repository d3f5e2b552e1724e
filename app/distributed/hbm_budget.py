"""How much of each device's memory the sharding planner gives the embedding tables, and what it keeps back.

TorchRec's ``HeuristicalStorageReservation`` reserves a share of each device, the dense part in training
and the pipeline's sparse inputs; this module feeds it the app's settings (``hbm_reserved_fraction``,
``hbm_reserved_bytes``), breaks its result down for the log and the plan report (``MemoryBudget``), and
makes rank 0 plan for the least HBM any rank has free.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace

import torch.distributed as dist
from torch import nn
from torchrec.distributed.planner.storage_reservations import HeuristicalStorageReservation
from torchrec.distributed.planner.types import ParameterConstraints, Topology
from torchrec.distributed.types import ModuleSharder, get_tensor_size_bytes

from app.distributed.topology import HBM_FREE_AT_PLANNING, DeviceTopology


@dataclass(frozen=True)
class MemoryBudget:
    """Per device, in bytes: its capacity, what the planner left free for everything but the tables, and
    what it let the tables fill. ``memory`` is ``hbm`` on GPUs, ``ddr`` (host memory) on CPU.

    Each table shard's own estimate (``ShardEstimate.hbm_bytes``) already holds its weights, its fused
    optimizer state and its lookup's inputs and outputs for one batch; the reservation is for the rest.
    """

    memory: str
    capacity_bytes: int  # as planned for: with topology auto, the least free on any rank
    fraction_bytes: int  # hbm_reserved_fraction of it: activations, NCCL and all-to-all buffers, fragmentation
    dense_bytes: int  # the dense part in training: weights, gradients, optimizer state, DDP buckets
    inputs_bytes: int  # sparse inputs (KJTs) of the pipeline's batches in flight, TorchRec's estimate
    extra_bytes: int  # hbm_reserved_bytes
    tables_bytes: int  # what the tables may fill

    @property
    def reserved_bytes(self) -> int:
        return self.capacity_bytes - self.tables_bytes


# TorchRec's heuristic for the dense part in training (HeuristicalStorageReservation's default): its
# parameters six times over, "parameter + optimizer (~2x parameter) + ddp (~3x parameter)": the weights,
# their gradients, up to two optimizer moments (Adam; Adagrad keeps one) and DDP's gradient buckets.
DENSE_PARAMETER_MULTIPLIER = 6.0


def dense_training_bytes(module: nn.Module, sharders: list[ModuleSharder[nn.Module]]) -> int:
    """Bytes the part of ``module`` outside the shardable modules takes in training, by TorchRec's heuristic:
    ``DENSE_PARAMETER_MULTIPLIER`` x its parameters, plus its buffers.

    TorchRec computes the same inside its reservation (module less shardable modules) but warns on
    every plan that its figure may be wrong when tensors are not materialised; computed here, the
    figure goes to the plan report and the reservation logs it instead of warning.
    """
    shardable = tuple(sharder.module_type for sharder in sharders)
    in_tables = {
        id(tensor)
        for sub in module.modules()
        if isinstance(sub, shardable)
        for tensor in [*sub.parameters(), *sub.buffers()]
    }
    parameters = sum(get_tensor_size_bytes(p) for p in module.parameters() if id(p) not in in_tables)
    buffers = sum(get_tensor_size_bytes(b) for b in module.buffers() if id(b) not in in_tables)
    return round(DENSE_PARAMETER_MULTIPLIER * parameters + buffers)


def storage_reservation(
    module: nn.Module,
    sharders: list[ModuleSharder[nn.Module]],
    *,
    compute_device: str,
    hbm_reserved_fraction: float,
    hbm_reserved_bytes: int,
) -> HeuristicalStorageReservation:
    """TorchRec's reservation of what is not a table: ``hbm_reserved_fraction`` of each device's HBM,
    the dense part (``dense_training_bytes``) plus ``hbm_reserved_bytes`` (GPUs only), and the sparse
    inputs of the pipeline's batches in flight (TorchRec's estimate: 2 batches x 10 copies of the ids).

    TorchRec's FixedPercentageStorageReservation (used before) reserves the fraction only; the dense
    part then had to fit in the same 15 % as the activations and buffers, whatever its size.
    """
    extra_bytes = hbm_reserved_bytes if compute_device != "cpu" else 0
    estimate = dense_training_bytes(module, sharders) + extra_bytes
    with warnings.catch_warnings():
        # Its constructor warns that its own dense estimate can be wrong for tables not materialised;
        # the estimate is passed in (see dense_training_bytes).
        warnings.simplefilter("ignore", FutureWarning)
        return HeuristicalStorageReservation(
            percentage=hbm_reserved_fraction,
            parameter_multiplier=DENSE_PARAMETER_MULTIPLIER,
            dense_tensor_estimate=estimate or None,  # 0 would make it compute (the same 0) and warn
        )


def memory_budget(
    topology: Topology,
    module: nn.Module,
    sharders: list[ModuleSharder[nn.Module]],
    constraints: dict[str, ParameterConstraints],
    batch_size: int,
    *,
    hbm_reserved_fraction: float,
    hbm_reserved_bytes: int,
) -> MemoryBudget:
    """What TorchRec's reservation (``storage_reservation``) leaves to the tables on each device, part by part."""
    reservation = storage_reservation(
        module, sharders, compute_device=topology.compute_device,
        hbm_reserved_fraction=hbm_reserved_fraction, hbm_reserved_bytes=hbm_reserved_bytes,
    )  # fmt: skip
    reserved = reservation.reserve(topology, batch_size, module, sharders, constraints)
    memory = "ddr" if topology.compute_device == "cpu" else "hbm"
    capacity = getattr(topology.devices[0].storage, memory)
    tables = getattr(reserved.devices[0].storage, memory)
    fraction = capacity - int((1 - hbm_reserved_fraction) * capacity) if memory == "hbm" else 0
    extra = hbm_reserved_bytes if memory == "hbm" else 0
    dense = dense_training_bytes(module, sharders)
    return MemoryBudget(
        memory=memory, capacity_bytes=capacity, fraction_bytes=fraction, dense_bytes=dense,
        inputs_bytes=capacity - tables - fraction - dense - extra, extra_bytes=extra, tables_bytes=tables,
    )  # fmt: skip


def least_hbm_over_ranks(device: DeviceTopology, process_group: dist.ProcessGroup) -> DeviceTopology:
    """``device`` with the least ``hbm_cap_bytes`` any rank of ``process_group`` found (rank 0 plans for all:
    with topology ``auto`` each rank has read the memory free on its own GPU)."""
    if device.hbm_cap_source != HBM_FREE_AT_PLANNING:
        return device  # a preset or an override: the same figure on every rank
    every = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(every, device.hbm_cap_bytes, group=process_group)
    return replace(device, hbm_cap_bytes=min(every), hbm_cap_source=f"{HBM_FREE_AT_PLANNING} (least over ranks)")


def describe_memory_budget(budget: MemoryBudget, device: DeviceTopology) -> str:
    """One line for the log: what the planner gave the tables per device, and what it kept back for what."""
    memory = "HBM" if budget.memory == "hbm" else "host memory"
    return (
        f"Sharding planner: {format_bytes(budget.tables_bytes)} of {memory} per device for the embedding tables, of "
        f"{format_bytes(budget.capacity_bytes)} ({device.hbm_cap_source if budget.memory == 'hbm' else 'preset'}); kept back: "
        f"{format_bytes(budget.fraction_bytes)} (hbm_reserved_fraction {device.hbm_reserved_fraction:g}), "
        f"{format_bytes(budget.dense_bytes)} dense part in training, {format_bytes(budget.inputs_bytes)} pipeline inputs, "
        f"{format_bytes(budget.extra_bytes)} hbm_reserved_bytes"
    )


def format_bytes(num_bytes: float) -> str:
    """Bytes in the largest binary unit that keeps the number at or above 1 (model sizes span KiB to TiB)."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= size:
            return f"{num_bytes / size:.2f} {unit}"
    return f"{num_bytes:.0f} bytes"
