"""A DataLoader whose position Lightning saves with every checkpoint, for exact mid-epoch resume.

Lightning stores the ``state_dict()`` of any dataloader that has one (its ``_Stateful`` protocol)
in the fit loop's checkpoint state and hands it back through ``load_state_dict`` before iterating.
A plain DataLoader has no position to save, so a resumed run would repeat the epoch's first batches.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from app.data.dataset import CriteoBatches, EpochBatchSampler


class ResumableBatchLoader(DataLoader):
    """Loads the whole batches of a ``CriteoBatches`` dataset and remembers how many it has handed out.

    Args:
        dataset: this rank's batches.
        num_workers: worker processes that assemble batches.
    """

    def __init__(self, dataset: CriteoBatches, num_workers: int = 0) -> None:
        super().__init__(
            dataset,
            batch_size=None,  # the dataset yields whole batches
            sampler=EpochBatchSampler(len(dataset)),
            num_workers=num_workers,
            persistent_workers=num_workers > 0,
            pin_memory=torch.cuda.is_available(),
        )
        self._next_batch = 0
        # Batches handed out but not trained on yet (a training pipeline's queue, kept up to date by
        # app.train.pipeline): a checkpoint resumes at the first of them.
        self.batches_in_flight = 0

    def __iter__(self) -> Iterator[Any]:
        sampler = self.sampler
        assert isinstance(sampler, EpochBatchSampler)
        self._next_batch = sampler.first_batch
        self.batches_in_flight = 0
        for batch in super().__iter__():
            # Counted before the batch is handed out: a checkpoint written while it is being trained
            # on must resume at the one after it.
            self._next_batch += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.sampler.epoch,
            "next_batch": self._next_batch - self.batches_in_flight,
            "global_batch_size": self._global_batch_size,
        }

    @property
    def _global_batch_size(self) -> int:
        return self.dataset.batch_size_per_rank * self.dataset.world_size

    def load_state_dict(self, state: dict[str, int]) -> None:
        # Positions count global batches, which are the same on any number of processes as long as
        # batch_size * world_size is (app/data/partition.py): only then is the next batch the right one.
        saved = state.get("global_batch_size", self._global_batch_size)
        if saved != self._global_batch_size and state["next_batch"] > 0:
            raise ValueError(
                f"data.batch_size = {self.dataset.batch_size_per_rank} on {self.dataset.world_size} processes makes "
                f"global batches of {self._global_batch_size} rows; the checkpoint stopped mid-epoch with {saved}: "
                f"set data.batch_size to {saved / self.dataset.world_size:g} to resume at the next unseen batch"
            )
        self.sampler.set_epoch(state["epoch"])
        self.sampler.resume_at(state["next_batch"])
