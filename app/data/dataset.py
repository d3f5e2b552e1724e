"""A rank's view of one split: whole batches, addressed by ``(epoch, batch_index)``.

Batches rather than rows are the unit so that a batch is assembled with a few vectorised gathers
(``DataLoader(batch_size=None)``) instead of collating B single rows in Python. The epoch is part of
the key because the shuffle order depends on it and the key is drawn in the main process by the
sampler, which Lightning tells the epoch (``set_epoch``), while the batch itself may be built in a
worker process.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from torch.utils.data import Dataset, Sampler

from app.data.batches import PADDING_ROW_ID, CriteoBatch, make_batch
from app.data.partition import num_batches, rank_slice
from app.data.tsv import CriteoArrays


class CriteoBatches(Dataset):
    """This rank's batches of a split held in memory.

    Args:
        arrays: the whole split (every rank holds the row order, so global batches can be shuffled).
        batch_size_per_rank: rows per batch on each rank.
        rank: this process's global rank.
        world_size: number of processes.
        shuffle: draw a new row order every epoch (from ``seed`` and the epoch).
        seed: seed of the shuffle.
        drop_remainder: drop the few rows that cannot be split evenly (training); otherwise pad.
    """

    def __init__(
        self,
        arrays: CriteoArrays,
        batch_size_per_rank: int,
        rank: int,
        world_size: int,
        shuffle: bool,
        seed: int,
        drop_remainder: bool,
    ) -> None:
        self.arrays = arrays
        self.batch_size_per_rank = batch_size_per_rank
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_remainder = drop_remainder
        self._num_batches = num_batches(len(arrays), batch_size_per_rank, world_size, drop_remainder)
        self._order_epoch: int | None = None
        self._order: np.ndarray | None = None

    def __len__(self) -> int:
        return self._num_batches

    def __getitem__(self, key: tuple[int, int]) -> CriteoBatch:
        epoch, batch_index = key
        start, stop = rank_slice(
            batch_index, len(self.arrays), self.batch_size_per_rank, self.world_size, self.rank, self.drop_remainder
        )
        rows = self._shuffled_order(epoch)[start:stop] if self.shuffle else np.arange(start, stop, dtype=np.int64)
        row_ids = rows
        if len(rows) == 0:  # evaluation tail: one padding row keeps this rank in step with the others
            rows = np.zeros(1, dtype=np.int64)
            row_ids = np.full(1, PADDING_ROW_ID, dtype=np.int64)
        a = self.arrays
        return make_batch(a.dense[rows], a.sparse[rows], a.labels[rows], row_ids)

    def _shuffled_order(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch:  # one permutation per epoch, cached for its batches
            self._order = np.random.default_rng([self.seed, epoch]).permutation(len(self.arrays))
            self._order_epoch = epoch
        assert self._order is not None
        return self._order


class EpochBatchSampler(Sampler[tuple[int, int]]):
    """Yields ``(epoch, batch_index)`` for every batch of the epoch Lightning last set."""

    def __init__(self, num_batches: int) -> None:
        self.num_batches = num_batches
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return ((self.epoch, index) for index in range(self.num_batches))
