"""Raw TSV converted once per job, by the converting ranks, while the others wait at a bounded barrier.

Local rank 0 of every node (``data.prepare_data_per_node``: a node-local cache) or global rank 0 alone
(a cache on storage every node sees) converts; the others wait at the strategy's barrier. That barrier
must be bounded: Lightning's own ``prepare_data`` hook waits on one that never times out
(``_InfiniteBarrier``, a gloo group with a 10,000-day timeout), so a converting rank stuck there
would hang the job. The data module therefore has no ``prepare_data`` hook and converts here, at the
start of ``setup``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

from lightning.pytorch import Trainer

from app.data.cache import DEFAULT_WAIT_S


@runtime_checkable
class BoundedBarrier(Protocol):
    """A strategy whose barrier gives up after ``barrier_timeout_s`` (the app's TorchRecStrategy)."""

    barrier_timeout_s: float

    def barrier(self, name: str | None = None) -> None: ...


def conversion_wait_s(trainer: Trainer | None) -> float:
    """How long a rank waits for another process converting the same cache folder: as long as the
    strategy's barrier waits (waiting longer would leave this rank converting after the others have
    given up), or the cache's own bound under a strategy without one."""
    strategy = trainer.strategy if trainer is not None else None
    return strategy.barrier_timeout_s if isinstance(strategy, BoundedBarrier) else DEFAULT_WAIT_S


def convert_on_converting_ranks(trainer: Trainer, per_node: bool, convert: Callable[[], None]) -> None:
    """Runs ``convert`` on the converting ranks, then every rank meets at the strategy's barrier; a
    conversion error is raised after the barrier (on the others too: they read it from the cache's
    record, app/data/cache.py), so that no rank is left waiting for one that has stopped."""
    converts = trainer.local_rank == 0 if per_node else trainer.global_rank == 0
    error: Exception | None = None
    if converts:
        try:
            convert()
        except Exception as failure:  # after the barrier: leaving now would leave the others waiting
            error = failure
    try:
        trainer.strategy.barrier("cache_conversion")
    except Exception:
        if error is None:
            raise
    if error is not None:
        raise error
