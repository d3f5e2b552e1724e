"""A TorchRec ShardingPlan as plain JSON data, and back.

A checkpoint records the plan it was written under; pickling the plan would make loading a
checkpoint run whatever code the pickle names, so it is stored as JSON instead. TorchRec offers no
serialisation of its own (its plans are dataclasses holding ShardingSpecs and enums), hence this.

The plans this app makes (embedding bag tables, fused kernels) carry no key-value parameters, and
cache parameters only as ``strategy.table_constraints.<table>.cache_load_factor`` sets them; a plan
with anything else there is refused with a message rather than written incompletely.
"""

from __future__ import annotations

from typing import Any

from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode, CacheAlgorithm
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec
from torchrec.distributed.types import CacheParams, EmbeddingModuleShardingPlan, ParameterSharding, ShardingPlan
from torchrec.types import DataType

FORMAT_VERSION = 1


def plan_to_json(plan: ShardingPlan) -> dict[str, Any]:
    """The plan as a dict of str, int, bool, None and lists only (``json.dumps`` takes it as is)."""
    modules = {}
    for module_path, module_plan in plan.plan.items():
        if not isinstance(module_plan, EmbeddingModuleShardingPlan):
            raise ValueError(f"sharding plan of {module_path}: {type(module_plan).__name__} cannot be stored as JSON")
        modules[module_path] = {name: _parameter_to_json(f"{module_path}.{name}", p) for name, p in module_plan.items()}
    return {"format_version": FORMAT_VERSION, "modules": modules}


def plan_from_json(data: dict[str, Any]) -> ShardingPlan:
    """The ShardingPlan that :func:`plan_to_json` turned into ``data``."""
    if data.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"sharding plan format {data.get('format_version')!r}: this app reads format {FORMAT_VERSION}")
    return ShardingPlan(
        {
            module_path: EmbeddingModuleShardingPlan({name: _parameter_from_json(p) for name, p in params.items()})
            for module_path, params in data["modules"].items()
        }
    )


def _parameter_to_json(where: str, sharding: ParameterSharding) -> dict[str, Any]:
    if getattr(sharding, "key_value_params", None) is not None:
        raise ValueError(f"sharding plan of {where}: key_value_params cannot be stored in a checkpoint yet")
    spec = sharding.sharding_spec
    if spec is not None and not isinstance(spec, EnumerableShardingSpec):
        raise ValueError(f"sharding plan of {where}: {type(spec).__name__} cannot be stored as JSON")
    bounds = getattr(sharding, "bounds_check_mode", None)
    output_dtype = getattr(sharding, "output_dtype", None)
    return {
        "sharding_type": sharding.sharding_type,
        "compute_kernel": sharding.compute_kernel,
        "ranks": None if sharding.ranks is None else [int(r) for r in sharding.ranks],
        "shards": None if spec is None else [_shard_to_json(shard) for shard in spec.shards],
        "enforce_hbm": getattr(sharding, "enforce_hbm", None),
        "stochastic_rounding": getattr(sharding, "stochastic_rounding", None),
        "bounds_check_mode": None if bounds is None else bounds.name,
        "output_dtype": None if output_dtype is None else output_dtype.name,
        "cache_params": _cache_params_to_json(where, getattr(sharding, "cache_params", None)),
    }


def _cache_params_to_json(where: str, cache: CacheParams | None) -> dict[str, Any] | None:
    if cache is None:
        return None
    for unsupported in ("stats", "multipass_prefetch_config"):
        if getattr(cache, unsupported) is not None:
            raise ValueError(f"sharding plan of {where}: cache_params.{unsupported} cannot be stored in a checkpoint yet")
    return {
        "algorithm": None if cache.algorithm is None else cache.algorithm.name,
        "load_factor": cache.load_factor,
        "reserved_memory": cache.reserved_memory,
        "precision": None if cache.precision is None else cache.precision.name,
        "prefetch_pipeline": cache.prefetch_pipeline,
    }


def _cache_params_from_json(data: dict[str, Any]) -> CacheParams:
    return CacheParams(
        algorithm=None if data["algorithm"] is None else CacheAlgorithm[data["algorithm"]],
        load_factor=data["load_factor"],
        reserved_memory=data["reserved_memory"],
        precision=None if data["precision"] is None else DataType[data["precision"]],
        prefetch_pipeline=data["prefetch_pipeline"],
    )


def _parameter_from_json(data: dict[str, Any]) -> ParameterSharding:
    optional = {}
    for name in ("enforce_hbm", "stochastic_rounding"):
        if data.get(name) is not None:
            optional[name] = data[name]
    if data.get("bounds_check_mode") is not None:
        optional["bounds_check_mode"] = BoundsCheckMode[data["bounds_check_mode"]]
    if data.get("output_dtype") is not None:
        optional["output_dtype"] = DataType[data["output_dtype"]]
    if data.get("cache_params") is not None:  # absent from plans written before it was stored
        optional["cache_params"] = _cache_params_from_json(data["cache_params"])
    shards = data["shards"]
    return ParameterSharding(
        sharding_type=data["sharding_type"],
        compute_kernel=data["compute_kernel"],
        ranks=data["ranks"],
        sharding_spec=None if shards is None else EnumerableShardingSpec([_shard_from_json(s) for s in shards]),
        **optional,
    )


def _shard_to_json(shard: ShardMetadata) -> dict[str, Any]:
    return {
        "offsets": [int(o) for o in shard.shard_offsets],
        "sizes": [int(s) for s in shard.shard_sizes],
        "placement": None if shard.placement is None else str(shard.placement),
    }


def _shard_from_json(data: dict[str, Any]) -> ShardMetadata:
    return ShardMetadata(shard_offsets=data["offsets"], shard_sizes=data["sizes"], placement=data["placement"])
