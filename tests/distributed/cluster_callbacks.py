"""Test-only callbacks that break one rank on purpose, passed with ``--trainer.callbacks+=``.

They live under tests/ so that no production setting can trigger them.
"""

from __future__ import annotations

import os
import signal
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

from app.distributed import health


class StopRank(Callback):
    """Sends ``signal_name`` to global rank ``rank`` after training batch ``at_batch``: SIGKILL as a
    crashed process (its sockets close), SIGSTOP as a frozen node (its sockets stay open, silent)."""

    def __init__(self, rank: int = 1, at_batch: int = 2, signal_name: str = "SIGKILL") -> None:
        self.rank = rank
        self.at_batch = at_batch
        self.signal = signal.Signals[signal_name]

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_rank == self.rank and batch_idx == self.at_batch:
            os.kill(os.getpid(), self.signal)


class VirtualTime:
    """Stands in for the ``time`` module in app.distributed.health: ``perf_counter`` reads a clock that
    moves only when SlowRank moves it, so the times between steps RankHealth measures are exact."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def perf_counter(self) -> float:
        return self.now_s


class SlowRank(Callback):
    """Global rank ``rank`` takes ``delay_s`` longer before every training batch, as a straggling node
    would, on the clock RankHealth reads (a virtual one: no rank sleeps, and no other rank's time moves).

    RankHealth reads ``time.perf_counter`` through its module's ``time``, which ``setup`` replaces on
    every rank; it has no clock of its own to pass (app/distributed/health.py). Runs before RankHealth's
    hooks (LightningCLI puts trainer.callbacks before the rank_health callback), so the delay falls
    between RankHealth's end of one batch and start of the next.
    """

    def __init__(self, rank: int = 1, delay_s: float = 0.25) -> None:
        self.rank = rank
        self.delay_s = delay_s
        self.clock = VirtualTime()

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        health.time = self.clock  # type: ignore[assignment]

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_rank == self.rank:
            self.clock.now_s += self.delay_s
