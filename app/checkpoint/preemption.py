"""Save a complete checkpoint when the scheduler pre-empts the job (SIGTERM, SIGUSR1), then stop.

SLURM sends the signal named by ``#SBATCH --signal=SIGUSR1@90`` 90 s before the end of the
allocation; Kubernetes and ``scancel`` send SIGTERM. Lightning's own handlers do not fit a sharded
checkpoint: its SIGUSR1 handler saves from inside the signal handler (a collective there deadlocks
when the signal reaches only some ranks) and its SIGTERM handler exits without saving. Here the
handler only records the signal; after each training batch all ranks agree (an all-reduce of "did
any rank get a signal") and then every rank takes part in the save, at a batch boundary, so the
checkpoint resumes exactly at the next batch. Under SLURM with auto-requeue (Lightning's default),
SIGUSR1 then requeues the job as Lightning's own handler would (``scontrol requeue``).
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

_SIGNALS = {"SIGTERM": signal.SIGTERM, "SIGUSR1": signal.SIGUSR1}


class SaveOnSignal(Callback):
    """On SIGTERM or SIGUSR1 (to any rank) every rank saves ``last.ckpt`` after the current batch, then fit stops.

    The checkpoint goes into the checkpoint group's folder (``<default_root_dir>/checkpoints``), where
    ``--ckpt_path last`` finds it.

    Args:
        signals: the signals that trigger the save (SIGTERM, SIGUSR1); an empty list turns it off.
        check_every_n_steps: how often, in training steps, the ranks agree whether a signal arrived.
            Each check is one small all-reduce and, on GPUs, a device-to-host sync that stalls the
            overlapped pipeline, hence not every step; SLURM's ``--signal=SIGUSR1@90`` leaves 90 s,
            far more than a few steps.
    """

    def __init__(self, signals: list[str] = ["SIGTERM", "SIGUSR1"], check_every_n_steps: int = 10) -> None:
        unknown = sorted(set(signals) - set(_SIGNALS))
        if unknown:
            raise ValueError(f"save_on_signal.signals: {unknown} unknown; choose from {sorted(_SIGNALS)}")
        if check_every_n_steps < 1:
            raise ValueError(f"save_on_signal.check_every_n_steps = {check_every_n_steps}: must be at least 1")
        self.signals = list(signals)
        self.check_every_n_steps = check_every_n_steps
        self._received: int = 0  # the signal number, 0 while none arrived
        self._previous_handlers: dict[int, Any] = {}
        self._loop_without_broadcast: Any = None  # Lightning's epoch loop while its SIGTERM broadcast is skipped

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Installed here because Lightning installs its own handlers after the setup hooks.
        self._received = 0
        for name in self.signals:
            self._previous_handlers[_SIGNALS[name]] = signal.signal(_SIGNALS[name], self._record)
        if "SIGTERM" in self.signals:
            self._skip_lightning_sigterm_broadcast(trainer)

    def _skip_lightning_sigterm_broadcast(self, trainer: Trainer) -> None:
        # Lightning 2.6 broadcasts "rank 0 got SIGTERM" before every training step: a collective
        # and, on GPUs, a device-to-host sync that stalls the overlapped pipeline (~1 ms a step on
        # 2 CPU processes). With this callback's handler in place Lightning's flag is never set, so
        # that broadcast would only ever send 0; the check above, every N steps, replaces it.
        loop = trainer.fit_loop.epoch_loop
        if hasattr(loop, "_broadcast_sigterm_tensor"):
            loop._broadcast_sigterm_tensor = lambda: None  # an instance attribute: deleting it restores Lightning's
            self._loop_without_broadcast = loop

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self._received = signum

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # global_step is the same on every rank, so all ranks take part in the same checks.
        if not self._previous_handlers or trainer.global_step % self.check_every_n_steps:
            return
        any_signal, any_sigusr1 = self._agreed_signals(trainer)
        if not any_signal:
            return
        path = self._checkpoint_path(trainer)
        trainer.save_checkpoint(path)
        name = signal.Signals(self._received).name if self._received else "a signal on another rank"
        rank_zero_info(f"{name}: saved {path} at step {trainer.global_step}; stopping (resume with --ckpt_path last)")
        trainer.should_stop = True
        self._restore_handlers()
        environment = trainer.strategy.cluster_environment
        on_slurm = isinstance(environment, SLURMEnvironment) and environment.auto_requeue
        if any_sigusr1 and on_slurm and trainer.is_global_zero:
            requeue_slurm_job()

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._restore_handlers()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._restore_handlers()

    def _agreed_signals(self, trainer: Trainer) -> tuple[bool, bool]:
        """(any rank got a signal, any rank got SIGUSR1): a signal may reach only some ranks."""
        flags = [1 if self._received else 0, 1 if self._received == signal.SIGUSR1 else 0]
        received = torch.tensor(flags, device=trainer.strategy.root_device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(received, op=dist.ReduceOp.MAX)
        any_signal, any_sigusr1 = received.tolist()
        return bool(any_signal), bool(any_sigusr1)

    @staticmethod
    def _checkpoint_path(trainer: Trainer) -> str:
        callback = trainer.checkpoint_callback
        folder = callback.dirpath if isinstance(callback, ModelCheckpoint) and callback.dirpath else None
        folder = folder or os.path.join(trainer.default_root_dir, "checkpoints")
        return str(Path(folder) / f"{ModelCheckpoint.CHECKPOINT_NAME_LAST}{ModelCheckpoint.FILE_EXTENSION}")

    def _restore_handlers(self) -> None:
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        self._previous_handlers = {}
        if self._loop_without_broadcast is not None:
            del self._loop_without_broadcast._broadcast_sigterm_tensor
            self._loop_without_broadcast = None


SCONTROL_MISSING = 127  # the shell's status for a command not found


def requeue_slurm_job() -> int:
    """Puts this SLURM job back in the queue (``scontrol requeue``); returns scontrol's exit code
    (``SCONTROL_MISSING`` where there is no scontrol: a warning, not an error -- the checkpoint is saved)."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job_id = f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job else os.environ["SLURM_JOB_ID"]
    try:
        result = subprocess.run(["scontrol", "requeue", job_id], check=False).returncode
    except FileNotFoundError:
        # Containers often lack SLURM's client tools. Lightning's own handler catches this too.
        rank_zero_warn(
            f"scontrol is not on PATH here: SLURM job {job_id} was not requeued; its checkpoint is saved, "
            "resubmit it with --ckpt_path last (or mount SLURM's tools into the container)"
        )
        return SCONTROL_MISSING
    rank_zero_info(f"requeued SLURM job {job_id}" if result == 0 else f"scontrol requeue {job_id} failed ({result})")
    return result
