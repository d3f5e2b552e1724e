"""Test-only callbacks that break one rank on purpose, passed with ``--trainer.callbacks+=``.

They live under tests/ so that no production setting can trigger them.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer


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


class SlowRank(Callback):
    """Delays every training batch of global rank ``rank`` by ``delay_s``, as a straggling node would."""

    def __init__(self, rank: int = 1, delay_s: float = 0.2) -> None:
        self.rank = rank
        self.delay_s = delay_s

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_rank == self.rank:
            time.sleep(self.delay_s)
