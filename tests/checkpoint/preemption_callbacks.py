"""Test-only callbacks that pre-empt a run at an exact point, passed with ``--trainer.callbacks+=``.

The signal is sent from inside the run, at a given hook and step, so that what the run saved is known
exactly (no sleeps, no polling of files from outside). They live under tests/ so that no production
setting can trigger them. Passed before the app's own callbacks, they run first in each hook: a
signal sent at a step's ``on_train_batch_end`` reaches the sending rank before ``SaveOnSignal`` checks
at that same step.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import threading
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer


class SignalAt(Callback):
    """Sends ``signal_name`` from global rank ``rank`` at one point of the run.

    Args:
        signal_name: SIGUSR1, SIGTERM, SIGKILL, ...
        at: ``setup`` (the setup hook: after the raw-TSV conversion, before Lightning installs its handlers),
            ``train`` (``on_train_batch_end`` of global step ``step``) or ``validation``
            (``on_validation_batch_end`` of batch ``batch`` of the first validation after step ``step``,
            not the sanity check).
        step: the global step (see ``at``).
        batch: the validation batch (see ``at``).
        rank: the global rank that sends it.
        to: ``group`` (the whole process group: every rank and loader worker, as SLURM's ``--signal``
            and ``scancel`` do) or ``self`` (the sending rank only).
    """

    def __init__(
        self, signal_name: str = "SIGUSR1", at: str = "train", step: int = 0, batch: int = 0, rank: int = 0, to: str = "group"
    ) -> None:
        assert at in ("setup", "train", "validation") and to in ("group", "self")
        self.signal = signal.Signals[signal_name]
        self.at, self.step, self.batch, self.rank, self.to = at, step, batch, rank, to

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.at == "setup":
            self._send(trainer)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.at == "train" and trainer.global_step == self.step:
            self._send(trainer)

    def on_validation_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self.at == "validation" and not trainer.sanity_checking and trainer.global_step == self.step:
            if batch_idx == self.batch:
                self._send(trainer)

    def _send(self, trainer: Trainer) -> None:
        if trainer.global_rank != self.rank:
            return
        if self.to == "group":
            # Sent by another process, as slurmstepd or scancel send it: loader workers end on a SIGTERM
            # from their own rank (as multiprocessing sends it at exit), and ignore it from anyone else.
            # kill has sent it to every process of the group before it exits, this rank included.
            subprocess.run(["kill", f"-{self.signal.name[3:]}", "--", f"-{os.getpgid(0)}"], check=False, timeout=60)
        else:
            os.kill(os.getpid(), self.signal)


class HoldSaveAt(Callback):
    """Holds every rank inside the checkpoint save at global step ``step`` for ``hold_s`` seconds: a save
    that outlasts the pre-emption warning (a 200 GB checkpoint on a slow filesystem)."""

    def __init__(self, step: int = 0, hold_s: float = 60.0) -> None:
        self.step = step
        self.hold_s = hold_s

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        if trainer.global_step == self.step:
            threading.Event().wait(self.hold_s)  # nothing sets it: a save that takes hold_s longer


class ReportSignalsAtExit(Callback):
    """Prints, as the process exits, what SIGTERM and SIGUSR1 do then (``at exit: SIGTERM ignored, ...``).

    Registered with ``atexit`` in the setup hook, so it runs after any exit handler the run registers
    later (atexit runs them last in, first out): it reports what a signal arriving during the rest of
    the interpreter's shutdown would meet."""

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        atexit.register(_report_signals)


def _report_signals() -> None:
    names = {signal.SIG_IGN: "ignored", signal.SIG_DFL: "default"}
    found = [f"{s.name} {names.get(signal.getsignal(s), 'handled')}" for s in (signal.SIGTERM, signal.SIGUSR1)]
    print(f"at exit: {', '.join(found)}", flush=True)
