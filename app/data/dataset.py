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
from app.data.source import RowSource


class CriteoBatches(Dataset):
    """This rank's batches of a split.

    Args:
        source: the rows of the whole split (every rank addresses all of it, so that global batches
            can be shuffled and split the same way on every rank).
        batch_size_per_rank: rows per batch on each rank.
        rank: this process's global rank.
        world_size: number of processes.
        shuffle: draw a new order every epoch (from ``seed`` and the epoch): of the rows for sources in
            memory, of the global batches for memory-mapped ones (contiguous reads at any size).
        seed: seed of the shuffle.
        drop_remainder: drop the few rows that cannot be split evenly (training); otherwise pad.
    """

    def __init__(
        self,
        source: RowSource,
        batch_size_per_rank: int,
        rank: int,
        world_size: int,
        shuffle: bool,
        seed: int,
        drop_remainder: bool,
    ) -> None:
        self.source = source
        self.batch_size_per_rank = batch_size_per_rank
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_remainder = drop_remainder
        self._num_batches = num_batches(len(source), batch_size_per_rank, world_size, drop_remainder)
        self._order_epoch: int | None = None
        self._order: np.ndarray | None = None

    def __len__(self) -> int:
        return self._num_batches

    def __getitem__(self, key: tuple[int, int]) -> CriteoBatch:
        epoch, batch_index = key
        rows = self._rows(epoch, batch_index)
        row_ids = rows
        if len(rows) == 0:  # evaluation tail: one padding row keeps this rank in step with the others
            rows = np.zeros(1, dtype=np.int64)
            row_ids = np.full(1, PADDING_ROW_ID, dtype=np.int64)
        return make_batch(self.source.take(rows), row_ids)

    def _rows(self, epoch: int, batch_index: int) -> np.ndarray:
        """Positions in the source of this rank's rows in step ``batch_index`` of ``epoch``."""
        if self.shuffle and not self.source.in_memory:
            batch_index = int(self._permutation(epoch, self._num_batches)[batch_index])
        start, stop = rank_slice(
            batch_index, len(self.source), self.batch_size_per_rank, self.world_size, self.rank, self.drop_remainder
        )
        if self.shuffle and self.source.in_memory:
            return self._permutation(epoch, len(self.source))[start:stop]
        return np.arange(start, stop, dtype=np.int64)

    def _permutation(self, epoch: int, size: int) -> np.ndarray:
        if self._order_epoch != epoch:  # one permutation per epoch, cached for its batches
            self._order = np.random.default_rng([self.seed, epoch]).permutation(size)
            self._order_epoch = epoch
        assert self._order is not None
        return self._order


class EpochBatchSampler(Sampler[tuple[int, int]]):
    """Yields ``(epoch, batch_index)`` for every batch of the epoch Lightning last set.

    After ``resume_at(k)`` the passes of the current epoch start at batch k instead of 0: how a run
    restored from a mid-epoch checkpoint continues at exactly the next batch. The next epoch, or a
    pass that ran to the end, starts at 0 again. (Not reset when a pass starts: a DataLoader with
    persistent workers calls ``iter`` on its sampler twice for its first pass.)
    """

    def __init__(self, num_batches: int) -> None:
        self.num_batches = num_batches
        self.epoch = 0
        self._first_batch = 0

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self._first_batch = 0
        self.epoch = epoch

    def resume_at(self, batch_index: int) -> None:
        # A checkpoint taken after the last batch resumes with a whole epoch.
        self._first_batch = batch_index if batch_index < self.num_batches else 0

    @property
    def first_batch(self) -> int:
        """The batch the next pass starts at."""
        return self._first_batch

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[tuple[int, int]]:
        for index in range(self._first_batch, self.num_batches):
            yield self.epoch, index
        self._first_batch = 0
