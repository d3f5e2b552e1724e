"""A sharding plan's placements are rewritten to the devices of the run that uses it (app/distributed/placements.py).

torch refuses a shard whose tensor sits on another device than its placement names, so a plan saved
on CPU and resumed on GPUs, a plan from 2 nodes x 8 GPUs resumed on 4 x 4, and TorchRec's own
``cuda:{rank % local_world_size}`` under ``trainer.devices: [4, 5, 6, 7]`` must all be re-placed.
"""

from __future__ import annotations

import torch
from torchrec.distributed.sharding_plan import (
    EmbeddingBagCollectionSharder,
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    table_wise,
)
from torchrec.distributed.types import ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from app.checkpoint.reshard import plan_allows, same_layout
from app.distributed.placements import device_of_rank, plan_on_devices

MODULE = "model.sparse_arch.embedding_bag_collection"


def _plan(device_type: str, world_size: int, local_size: int) -> ShardingPlan:
    """t0 on the last rank, t1 in one column shard per rank, t2 data-parallel, as TorchRec's planner places them."""
    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=4 * world_size, num_embeddings=10, feature_names=[f"f{i}"])
        for i in range(3)
    ]
    collection = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    module_plan = construct_module_sharding_plan(
        collection,
        per_param_sharding={
            "t0": table_wise(rank=world_size - 1),
            "t1": column_wise(ranks=list(range(world_size))),
            "t2": data_parallel(),
        },
        local_size=local_size,
        world_size=world_size,
        device_type=device_type,
        sharder=EmbeddingBagCollectionSharder(),
    )
    return ShardingPlan({MODULE: module_plan})


def _placements(plan: ShardingPlan, table: str) -> list[str]:
    spec = plan.plan[MODULE][table].sharding_spec
    return [str(shard.placement) for shard in spec.shards]


def _cuda(*indices: int) -> list[torch.device]:
    return [torch.device("cuda", i) for i in indices]


def test_a_cpu_plan_resumed_on_two_gpus_names_each_ranks_gpu():
    saved = _plan("cpu", world_size=2, local_size=2)
    assert _placements(saved, "t1") == ["rank:0/cpu", "rank:1/cpu"]
    placed = plan_on_devices(saved, _cuda(0, 1))
    assert _placements(placed, "t0") == ["rank:1/cuda:1"]
    assert _placements(placed, "t1") == ["rank:0/cuda:0", "rank:1/cuda:1"]
    assert placed.plan[MODULE]["t2"].sharding_spec is None  # data-parallel: nothing placed
    assert _placements(saved, "t1") == ["rank:0/cpu", "rank:1/cpu"]  # the saved plan is left as it was


def test_a_gpu_plan_resumed_on_cpu_names_the_cpu():
    placed = plan_on_devices(_plan("cuda", world_size=2, local_size=2), [torch.device("cpu")] * 2)
    assert _placements(placed, "t0") == ["rank:1/cpu"]
    assert _placements(placed, "t1") == ["rank:0/cpu", "rank:1/cpu"]


def test_the_planners_placements_under_devices_4_to_7_move_to_those_gpus():
    planned = _plan("cuda", world_size=4, local_size=4)
    assert _placements(planned, "t1") == ["rank:0/cuda:0", "rank:1/cuda:1", "rank:2/cuda:2", "rank:3/cuda:3"]
    placed = plan_on_devices(planned, _cuda(4, 5, 6, 7))
    assert _placements(placed, "t0") == ["rank:3/cuda:7"]
    assert _placements(placed, "t1") == ["rank:0/cuda:4", "rank:1/cuda:5", "rank:2/cuda:6", "rank:3/cuda:7"]


def test_a_two_by_eight_plan_resumed_on_four_nodes_of_four_gpus():
    saved = _plan("cuda", world_size=16, local_size=8)
    assert _placements(saved, "t1")[8:10] == ["rank:8/cuda:0", "rank:9/cuda:1"]
    placed = plan_on_devices(saved, _cuda(0, 1, 2, 3))
    assert _placements(placed, "t0") == ["rank:15/cuda:3"]
    assert _placements(placed, "t1") == [f"rank:{r}/cuda:{r % 4}" for r in range(16)]
    # Only the devices changed: the same shards on the same ranks, so the plan still fits the run.
    assert same_layout(saved, placed)
    assert plan_allows(placed, {}, world_size=16)


def test_the_device_of_a_rank_repeats_the_node_list_on_every_node():
    assert [device_of_rank(r, _cuda(4, 5)).index for r in range(6)] == [4, 5, 4, 5, 4, 5]
