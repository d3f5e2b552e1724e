"""Random Criteo-shaped batches for benchmarks, the same for the app and the plain TorchRec loop.

Like TorchRec's ``RandomRecDataset`` (which its DLRM trainer uses for random data), a few batches are
generated once and then cycled, so that generating data is not what gets measured. That class is not
used as it is because its labels are int64 and its batches lack the row ids the app's batches carry.

For a GPU run the generated batches are pinned once (page-locked host memory), as the app's own
loader pins its batches (``app/data/loader.py``): only from pinned memory does a ``non_blocking``
copy to the GPU run asynchronously, which the pipelines' copy stream relies on to overlap it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, IterableDataset
from torchrec.datasets.criteo import DEFAULT_CAT_NAMES
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from app.criteo import NUM_DENSE
from app.data.batches import CriteoBatch


@dataclass
class RandomData:
    """Shape of the random batches (ignored when a dataset is given: dataset.train or dataset.split).

    Args:
        num_tables: embedding tables, one per categorical feature (the first n of C1..C26).
        rows_per_table: rows of every table, or one size per table.
        ids_per_lookup: ids pooled into each table lookup (the pooling factor), for every table or
            one per table; every row has exactly this many ids, uniformly random over the table.
        batch_size_per_rank: rows per step on each process.
        num_generated_batches: distinct batches generated per process and then cycled.
    """

    num_tables: int = 26
    rows_per_table: int | list[int] = 100_000
    ids_per_lookup: int | list[int] = 1
    batch_size_per_rank: int = 512
    num_generated_batches: int = 10

    def table_rows(self) -> list[int]:
        return self._per_table(self.rows_per_table, "rows_per_table")

    def pooling_factors(self) -> list[int]:
        return self._per_table(self.ids_per_lookup, "ids_per_lookup")

    def table_setting(self) -> str:
        """The setting that sized the tables, for messages."""
        return f"data.rows_per_table = {self.rows_per_table}"

    def batch_bytes(self) -> int:
        return batch_bytes(self.batch_size_per_rank, self.pooling_factors())

    def mapped_data_bytes(self, steps: int) -> int:
        """None: the batches are generated in memory (no data files mapped)."""
        return 0

    def _per_table(self, value: int | list[int], name: str) -> list[int]:
        if not 1 <= self.num_tables <= len(DEFAULT_CAT_NAMES):
            raise ValueError(f"data.num_tables = {self.num_tables} must be within 1..{len(DEFAULT_CAT_NAMES)}")
        values = [value] * self.num_tables if isinstance(value, int) else list(value)
        if len(values) != self.num_tables or min(values) < 1:
            raise ValueError(f"data.{name} = {value}: give one positive int, or one per table ({self.num_tables})")
        return values


def batch_bytes(batch_size: int, pooling_factors: list[int] | list[float]) -> int:
    """Bytes of one batch in memory: per row 13 float32 dense features, a float32 label, an int64 row
    id, and per table its int64 ids and an int32 length."""
    per_row = NUM_DENSE * 4 + 4 + 8 + 8 * sum(pooling_factors) + 4 * len(pooling_factors)
    return int(batch_size * per_row)


def random_batch(data: RandomData, generator: torch.Generator) -> CriteoBatch:
    """One batch: dense features N(0, 1), labels 0/1, and a fixed-size bag of uniform ids per table."""
    size = data.batch_size_per_rank
    pooling, rows = data.pooling_factors(), data.table_rows()
    values = torch.cat([torch.randint(0, r, (size * m,), generator=generator) for r, m in zip(rows, pooling)])
    lengths = torch.tensor(pooling, dtype=torch.int32).repeat_interleave(size)
    return CriteoBatch(
        dense_features=torch.randn(size, NUM_DENSE, generator=generator),
        sparse_features=KeyedJaggedTensor.from_lengths_sync(
            keys=list(DEFAULT_CAT_NAMES[: data.num_tables]), values=values, lengths=lengths
        ),
        labels=torch.randint(0, 2, (size,), generator=generator).float(),
        row_ids=torch.arange(size),
    )


def pins_batches(device: torch.device) -> bool:
    """Whether batches for ``device`` are pinned: for a GPU (CUDA, or ROCm, which torch calls cuda)
    only; a CPU run copies nothing, and pinning needs a GPU driver."""
    return device.type == "cuda"


class RandomBatches(IterableDataset):
    """``num_batches`` batches cycled from a pool generated from ``seed`` (different on every rank),
    pinned once with ``pin_memory`` (rather than by the DataLoader, which would copy every batch again)."""

    def __init__(self, data: RandomData, num_batches: int, seed: int, pin_memory: bool = False) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.pool = [random_batch(data, generator) for _ in range(data.num_generated_batches)]
        if pin_memory:
            self.pool = [batch.pin_memory() for batch in self.pool]
        self.num_batches = num_batches

    def __iter__(self) -> Iterator[CriteoBatch]:
        return (self.pool[i % len(self.pool)] for i in range(self.num_batches))

    def __len__(self) -> int:
        return self.num_batches


def random_loader(data: RandomData, num_batches: int, seed: int, pin_memory: bool = False) -> DataLoader:
    """Already-built batches: no collation, no worker processes (both sides get the same loader)."""
    return DataLoader(RandomBatches(data, num_batches, seed, pin_memory), batch_size=None)


class RandomDataModule(LightningDataModule):
    """The random batches as a LightningDataModule, for the app's side of the benchmark."""

    def __init__(self, data: RandomData, num_batches: int, seed: int, pin_memory: bool = False) -> None:
        super().__init__()
        self.data, self.num_batches, self.seed, self.pin_memory = data, num_batches, seed, pin_memory

    def train_dataloader(self) -> DataLoader:
        return random_loader(self.data, self.num_batches, self.seed, self.pin_memory)
