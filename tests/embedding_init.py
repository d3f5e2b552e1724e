"""A callback that overwrites the sharded tables with reference weights, for sharded-vs-unsharded tests.

TorchRec initialises every shard from its own rank's random stream, so two runs with different
world sizes start from different tables. Copying one reference table into whatever shards a rank
holds makes the starting point identical, which is what the comparison needs.
"""

from __future__ import annotations

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.distributed._shard.sharded_tensor import ShardedTensor


def reference_tables(state_dict: dict, seed: int = 1234) -> dict[str, torch.Tensor]:
    """Full-size weights for every embedding table key in ``state_dict``, from a fixed seed."""
    tables = {}
    for index, (key, value) in enumerate(sorted(state_dict.items())):
        if ".embedding_bags." in key:
            generator = torch.Generator().manual_seed(seed + index)
            rows, cols = value.size()
            tables[key] = torch.rand(rows, cols, generator=generator) * 0.2 - 0.1
    return tables


class ReferenceEmbeddings(Callback):
    """Copies the reference tables into this rank's shards once the model is sharded."""

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        state_dict = pl_module.state_dict()
        tables = reference_tables(state_dict)
        with torch.no_grad():
            for key, table in tables.items():
                copy_into_local_shards(state_dict[key], table)


def copy_into_local_shards(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copies the part of ``full`` that this rank holds into ``target`` (a ShardedTensor or a replica)."""
    if not isinstance(target, ShardedTensor):
        target.copy_(full)
        return
    for shard in target.local_shards():
        (row, col), (rows, cols) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
        shard.tensor.copy_(full[row : row + rows, col : col + cols])
