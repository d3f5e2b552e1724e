"""A sharding plan's shard placements pointed at this run's devices.

A placement such as ``rank:3/cuda:3`` names the rank that holds a shard and the device the shard
lives on, and torch refuses a shard whose tensor is elsewhere (``Shard.__post_init__`` and
``ShardedTensor._init_from_local_shards_and_global_metadata`` compare the two devices). TorchRec's
planner writes ``cuda:{rank % local_world_size}`` (``torchrec.distributed.sharding_plan.placement``),
which is wrong for ``trainer.devices: [4, 5, 6, 7]`` (rank 0 runs on cuda:4), and a plan saved in a
checkpoint names the devices of the run that wrote it: CPU, another GPU index, another number of
GPUs per node. The rank of a shard is what the plan decides; its device follows from the rank on
the run that uses the plan, so every placement is rewritten from the rank alone.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch.distributed._shard.metadata import ShardMetadata
from torchrec.distributed.types import ShardingPlan


def device_of_rank(rank: int, node_devices: Sequence[torch.device]) -> torch.device:
    """The device global ``rank`` runs on when every node uses ``node_devices`` (Lightning's launch:
    the same device list on every node, ranks numbered node by node)."""
    return node_devices[rank % len(node_devices)]


def plan_on_devices(plan: ShardingPlan, node_devices: Sequence[torch.device]) -> ShardingPlan:
    """A copy of ``plan`` whose every shard placement names the device of its rank in this run.

    ``node_devices`` is this node's device list (``strategy.parallel_devices``), assumed the same on
    every node. Ranks, offsets and sizes stay as they are.
    """
    placed = copy.deepcopy(plan)
    for module_plan in placed.plan.values():
        for sharding in module_plan.values():  # type: ignore[union-attr]
            spec = sharding.sharding_spec
            if spec is None:  # data-parallel: a replica on every rank's own device
                continue
            spec.shards = [_placed(shard, node_devices) for shard in spec.shards]  # type: ignore[attr-defined]
    return placed


def _placed(shard: ShardMetadata, node_devices: Sequence[torch.device]) -> ShardMetadata:
    rank = shard.placement.rank()  # type: ignore[union-attr]
    device = device_of_rank(rank, node_devices)
    # str(device) is "cpu" for the CPU (no index) and "cuda:4" for a GPU, as torch's placements spell them.
    return ShardMetadata(
        shard_offsets=list(shard.shard_offsets), shard_sizes=list(shard.shard_sizes), placement=f"rank:{rank}/{device}"
    )
