"""A callback that records the embedding optimizer's state of every table as training starts.

For the resharding tests: a resumed run has loaded its checkpoint by then (Lightning restores before
``on_train_start``), so what it records is the state as loaded, before any step changes it.
"""

from __future__ import annotations

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.distributed._shard.sharded_tensor import ShardedTensor

ACCUMULATORS = ("momentum1", "sum")  # row-wise Adagrad's: fused kernels' and a replicated table's


def table_of(key: str) -> str:
    """``t_cat_3`` for any optimizer-state key of that table."""
    parts = key.split(".")
    return parts[parts.index("embedding_bags") + 1]


class LoadedAccumulators(Callback):
    """Keeps ``accumulators``: per table, its state key (``...momentum1`` fused, ``...sum`` replicated)
    and the (offset, values) pieces this rank holds, a replica as one piece at offset 0."""

    def __init__(self) -> None:
        self.accumulators: dict[str, tuple[str, list[tuple[int, torch.Tensor]]]] = {}

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        for param_key, param_state in trainer.optimizers[0].state_dict()["state"].items():
            for name, value in param_state.items():
                key = f"{param_key}.{name}"
                if not key.endswith(ACCUMULATORS) or ".embedding_bags." not in key:
                    continue
                if isinstance(value, ShardedTensor):
                    pieces = [(s.metadata.shard_offsets[0], s.tensor.clone()) for s in value.local_shards()]
                else:
                    pieces = [(0, value.clone())]
                self.accumulators[table_of(key)] = (key, pieces)
