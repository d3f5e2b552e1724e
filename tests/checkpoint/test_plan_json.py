"""A sharding plan survives the trip through JSON unchanged, for every sharding type CPUs offer."""

from __future__ import annotations

import json

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

from app.checkpoint.plan_json import plan_from_json, plan_to_json


def test_a_plan_of_every_cpu_sharding_type_round_trips_through_json():
    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=100 + i, feature_names=[f"f{i}"])
        for i in range(4)
    ]
    collection = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    module_plan = construct_module_sharding_plan(
        collection,
        per_param_sharding={
            "t0": table_wise(rank=1),
            "t1": column_wise(ranks=[0, 1]),
            "t2": data_parallel(),
            "t3": column_wise(ranks=[1, 1]),
        },
        local_size=2,
        world_size=2,
        device_type="cpu",
        sharder=EmbeddingBagCollectionSharder(),
    )
    plan = ShardingPlan({"model.sparse_arch.embedding_bag_collection": module_plan})

    text = json.dumps(plan_to_json(plan))
    restored = plan_from_json(json.loads(text))

    assert restored.plan.keys() == plan.plan.keys()
    for name, sharding in module_plan.items():
        assert restored.plan["model.sparse_arch.embedding_bag_collection"][name] == sharding, name
    # Column-wise shards keep their offsets, sizes and ranks.
    shards = restored.plan["model.sparse_arch.embedding_bag_collection"]["t1"].sharding_spec.shards
    assert [(s.shard_offsets, s.shard_sizes, str(s.placement)) for s in shards] == [
        ([0, 0], [101, 4], "rank:0/cpu"),
        ([0, 4], [101, 4], "rank:1/cpu"),
    ]
