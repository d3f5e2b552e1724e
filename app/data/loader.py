"""A DataLoader whose position Lightning saves with every checkpoint, for exact mid-epoch resume.

Lightning stores the ``state_dict()`` of any dataloader that has one (its ``_Stateful`` protocol)
in the fit loop's checkpoint state and hands it back through ``load_state_dict`` before iterating.
A plain DataLoader has no position to save, so a resumed run would repeat the epoch's first batches.

Its worker processes ignore the pre-emption signals (``ignore_preemption_signals``): SLURM's
``--signal`` and ``scancel`` signal every process of the job step, workers included, and a worker
must neither die of them (the rank would fail with "DataLoader worker exited unexpectedly") nor run
the handler it inherited from its rank; the rank itself acts on the signal (app/checkpoint/preemption.py).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from app.data.dataset import CriteoBatches, EpochBatchSampler


# The signals a scheduler pre-empts a job with: SIGUSR1 (SLURM's --signal) and SIGTERM (scancel, Kubernetes).
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def ignore_preemption_signals(worker_id: int) -> None:
    """A DataLoader ``worker_init_fn``: the worker ignores ``PREEMPTION_SIGNALS`` sent by anyone but its rank.

    Set in the worker rather than around the fork: torch installs its own SIGTERM handler in every
    worker when it starts (torch/utils/data/_utils/worker.py) and calls ``worker_init_fn`` after that.
    A module-level function, so that it pickles for workers started with ``spawn``.
    """
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    _end_on_sigterm_from_the_rank_only()


def _end_on_sigterm_from_the_rank_only() -> None:
    """SIGTERM from the worker's rank ends the worker at once, as torch's handler does; from anyone else
    it is ignored.

    Written by hand because neither torch nor Python offers it: torch's handler ends the worker for a
    SIGTERM from anyone (quietly from its rank, by the signal from others), and the rank relies on
    that at exit (multiprocessing terminates daemonic children with SIGTERM and then joins them), so
    the signal cannot simply be ignored. Python's handlers are not told the sender: the signal is
    blocked here and taken by a thread with ``sigwaitinfo``, which is.
    """
    rank_pid = os.getppid()
    # The worker has one thread now (a fork copies only the caller); those it starts later inherit the mask.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def take_sigterm() -> None:
        while True:
            if signal.sigwaitinfo({signal.SIGTERM}).si_pid == rank_pid:
                os._exit(0)

    threading.Thread(target=take_sigterm, name="sigterm_from_rank", daemon=True).start()


class ResumableBatchLoader(DataLoader):
    """Loads the whole batches of a ``CriteoBatches`` dataset and remembers how many it has handed out.

    Args:
        dataset: this rank's batches.
        num_workers: worker processes that assemble batches; they ignore the pre-emption signals.
    """

    def __init__(self, dataset: CriteoBatches, num_workers: int = 0) -> None:
        super().__init__(
            dataset,
            batch_size=None,  # the dataset yields whole batches
            sampler=EpochBatchSampler(len(dataset)),
            num_workers=num_workers,
            persistent_workers=num_workers > 0,
            pin_memory=torch.cuda.is_available(),
            worker_init_fn=ignore_preemption_signals,
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
