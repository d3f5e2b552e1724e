"""Save a complete checkpoint when the scheduler pre-empts the job (SIGTERM, SIGUSR1), requeue, then stop.

SLURM sends the signal named by ``#SBATCH --signal=SIGUSR1@90`` 90 s before the end of the
allocation, to every process of the step (loader workers included); Kubernetes and ``scancel`` send
SIGTERM. Lightning's own handlers do not fit a sharded checkpoint: its SLURM SIGUSR1 handler saves
from inside the signal handler and its SIGTERM handler broadcasts from inside the handler (a
collective there deadlocks when the signal reaches only some ranks). Here the handler only records
the signal. It is installed by the CLI before any work starts (the raw-TSV
conversion included), so Lightning, which installs its SLURM SIGUSR1 handler only where none is,
never installs it; its SIGTERM handler, which it installs whatever is there, is replaced again at
once (``setup``). Loader workers ignore both signals (``app.data.loader``).

At the next safe point (every ``check_every_n_steps`` training steps or evaluation batches, and
at the start of training) all ranks agree with one all-reduce whether any rank got a signal; then
every rank takes part in the save of ``last.ckpt``, rank 0 requeues a SLURM job (``scontrol
requeue``, as Lightning's handler would), and fit ends at once: no further validation, no further
checkpoint (Lightning's ``should_stop`` would run a validation and let ModelCheckpoint save twice
more). A signal before the first training step of the run saves nothing (there is nothing new
since the checkpoint the run started from) and stops the same way.

``scontrol requeue`` ends a running job (SIGTERM, then SIGKILL after SLURM's ``KillWait``), so a
requeue before the save would kill it. A save that has not finished ``requeue_after_s`` after rank 0
heard the signal is therefore overtaken: rank 0 requeues from a timer thread, and SLURM's kill then
lands mid-save, which leaves the previous ``last.ckpt`` in place (checkpoints are published
atomically, app/checkpoint/format.py). Either way the job is back in the queue before its time ends.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from app.data.loader import PREEMPTION_SIGNALS

_SIGNALS = {signal.Signals(signum).name: signum for signum in PREEMPTION_SIGNALS}


class Preempted(SIGTERMException):
    """Ends ``Trainer.fit`` (or validate/test/predict) after a pre-emption signal, with the exit status
    ``preempted_exit_status`` gives.

    Lightning's own exception for a signal-ended run: raised from a callback it skips the rest of the
    loops (the validation and the checkpoint saves that ``trainer.should_stop`` would still run),
    calls the callbacks' ``on_exception`` and tears the trainer down.
    """


class SaveOnSignal(Callback):
    """On SIGTERM or SIGUSR1 (to any rank) every rank saves ``last.ckpt`` at the next safe point, then fit stops.

    The checkpoint goes into the checkpoint group's folder (``<default_root_dir>/checkpoints``), where
    ``--ckpt_path last`` finds it. Under SLURM (auto-requeue, Lightning's default) SIGUSR1 also
    requeues the job. validate, test and predict stop at the next safe point without saving.

    Args:
        signals: the signals that trigger the save (SIGTERM, SIGUSR1); an empty list turns it off.
        check_every_n_steps: how often, in training steps and in evaluation batches, the ranks agree
            whether a signal arrived. Each check is one small all-reduce and, on GPUs, a device-to-host
            sync that stalls the overlapped pipeline, hence not every step; SLURM's
            ``--signal=SIGUSR1@90`` leaves 90 s, far more than a few steps.
        requeue_after_s: seconds after rank 0 hears SLURM's requeue signal by which the job is
            requeued even if the save has not finished (``scontrol requeue`` then ends the save; the
            previous ``last.ckpt`` stays valid). The requeue must come before the allocation ends:
            at most the signal's lead (``--signal=SIGUSR1@90``: 90 s) minus the few seconds scontrol
            takes. After the requeue SLURM sends SIGTERM and, ``KillWait`` (30 s by default) later,
            SIGKILL: a save still running by then is lost. The default 50 s leaves a save up to
            50 + 30 s with a 90 s warning.
    """

    def __init__(
        self,
        signals: list[str] = ["SIGTERM", "SIGUSR1"],
        check_every_n_steps: int = 10,
        requeue_after_s: float = 50.0,
    ) -> None:
        unknown = sorted(set(signals) - set(_SIGNALS))
        if unknown:
            raise ValueError(f"save_on_signal.signals: {unknown} unknown; choose from {sorted(_SIGNALS)}")
        if check_every_n_steps < 1:
            raise ValueError(f"save_on_signal.check_every_n_steps = {check_every_n_steps}: must be at least 1")
        if not requeue_after_s >= 0:
            raise ValueError(f"save_on_signal.requeue_after_s = {requeue_after_s}: must be >= 0 seconds")
        self.signals = list(signals)
        self.check_every_n_steps = check_every_n_steps
        self.requeue_after_s = requeue_after_s
        self._received: set[int] = set()  # the signals this process got
        self._previous_handlers: dict[int, Any] = {}  # the handlers before this callback's
        self._requeue_signal: int | None = None  # SLURM's, when this job is to be requeued
        self._requeues = False  # this process (global rank 0) is the one that requeues
        self._requeue_lock = threading.Lock()
        self._requeued = False
        self._requeue_status: int | None = None  # scontrol's exit status, once it ran
        self._requeue_timer: threading.Timer | None = None
        self._first_step: int | None = None  # global_step when this run's training started
        self._stopped = False
        self._unwrap: list[Any] = []  # undoes the changes to Lightning's objects

    # ---- the handlers ------------------------------------------------------------------------

    def install(self, trainer: Trainer) -> None:
        """Installs the recording handlers now; the CLI calls it before any work starts. Idempotent."""
        if self._previous_handlers or not self.signals:
            return
        self._received = set()
        self._stopped = False
        self._requeued = False
        self._requeue_signal, self._requeues = None, False
        # Lightning's single-device strategies have no cluster environment (and nothing to requeue).
        environment = getattr(trainer.strategy, "cluster_environment", None)
        if isinstance(environment, SLURMEnvironment) and environment.auto_requeue:
            self._requeue_signal = environment.requeue_signal
            # SLURMEnvironment reads the global rank from SLURM_PROCID: known before the process group.
            self._requeues = environment.global_rank() == 0
        for name in self.signals:
            self._previous_handlers[_SIGNALS[name]] = signal.signal(_SIGNALS[name], self._record)
        self._restart_interrupted_calls()

    def _reinstall(self) -> None:
        for signum in self._previous_handlers:
            signal.signal(signum, self._record)
        self._restart_interrupted_calls()

    def _restart_interrupted_calls(self) -> None:
        # The signal may land on any thread, e.g. one of gloo's or NCCL's in a socket call. Python retries
        # its own calls (PEP 475), but a C++ library may take EINTR for an error and fail a collective:
        # with SA_RESTART the kernel resumes the call instead.
        for signum in self._previous_handlers:
            signal.siginterrupt(signum, False)

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self._received.add(signum)
        if signum == self._requeue_signal and self._requeues:
            self._start_requeue_deadline()

    def _restore_handlers(self) -> None:
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        self._previous_handlers = {}

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.install(trainer)  # a trainer built without the app's CLI: from here on (after the data module's setup, which Lightning calls first)
        if not self._previous_handlers:
            return
        # Lightning registers its handlers after this hook and before the sanity check: for SIGTERM
        # always (a broadcast inside the handler), for SIGUSR1 only where no handler is. It has no
        # setting to leave a signal alone, so its registration is followed at once by this callback's
        # handlers again; its teardown then restores them too (it saved them as the ones before).
        connector = trainer._signal_connector
        register = type(connector).register_signal_handlers

        def register_then_keep_ours() -> None:
            register(connector)
            self._reinstall()

        connector.register_signal_handlers = register_then_keep_ours  # an instance attribute: deleted at teardown
        self._unwrap.append(lambda: delattr(connector, "register_signal_handlers"))
        if "SIGTERM" in self.signals:
            self._skip_lightning_sigterm_broadcast(trainer)

    def _skip_lightning_sigterm_broadcast(self, trainer: Trainer) -> None:
        # Lightning 2.6 broadcasts "rank 0 got SIGTERM" before every training step: a collective
        # and, on GPUs, a device-to-host sync that stalls the overlapped pipeline (~1 ms a step on
        # 2 CPU processes). With this callback's handler in place Lightning's flag is never set, so
        # that broadcast would only ever send 0; the check every N steps replaces it.
        loop = trainer.fit_loop.epoch_loop
        if hasattr(loop, "_broadcast_sigterm_tensor"):
            loop._broadcast_sigterm_tensor = lambda: None  # an instance attribute: deleting it restores Lightning's
            self._unwrap.append(lambda: delattr(loop, "_broadcast_sigterm_tensor"))

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._finish()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._finish()

    def _finish(self) -> None:
        for undo in self._unwrap:
            undo()
        self._unwrap = []
        if not self._stopped:
            # After a pre-emption the handlers stay: SLURM's SIGTERM after the requeue must find the
            # ranks finishing their teardown (loggers flushing), not kill them mid-way; at the
            # interpreter's exit the signals are then ignored (_ignore_signals_at_exit).
            self._cancel_requeue_deadline()
            self._restore_handlers()

    # ---- the requeue -------------------------------------------------------------------------

    def _start_requeue_deadline(self) -> None:
        if self._requeue_timer is None and not self._requeued:
            self._requeue_timer = threading.Timer(self.requeue_after_s, self._requeue_once, kwargs={"late": True})
            self._requeue_timer.daemon = True
            self._requeue_timer.start()

    def _cancel_requeue_deadline(self) -> None:
        if self._requeue_timer is not None:
            self._requeue_timer.cancel()
            self._requeue_timer = None

    def _requeue_once(self, late: bool = False) -> None:
        with self._requeue_lock:
            if self._requeued:
                return
            self._requeued = True
        if late:
            rank_zero_warn(
                f"the save after SLURM's requeue signal has not finished after save_on_signal.requeue_after_s = "
                f"{self.requeue_after_s:g} s: requeueing now; the job ends before the save does unless it finishes "
                "within SLURM's KillWait, and the previous last.ckpt stays the one to resume from"
            )
        self._requeue_status = requeue_slurm_job()

    # ---- the safe points ---------------------------------------------------------------------

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._first_step = trainer.global_step
        # A signal during set-up (the raw-TSV conversion included), loading or the sanity check: acted on before step one.
        self._check(trainer, due=True)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # global_step is the same on every rank, so all ranks take part in the same checks.
        self._check(trainer, due=trainer.global_step % self.check_every_n_steps == 0)

    def on_validation_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._check_evaluation(trainer, batch_idx)

    def on_test_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._check_evaluation(trainer, batch_idx)

    def on_predict_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._check_evaluation(trainer, batch_idx)

    def _check_evaluation(self, trainer: Trainer, batch_idx: int) -> None:
        # Every rank evaluates the same number of batches (app/data/partition.py pads the split), so
        # every rank reaches the same checks; a long validation does not delay the save to its end.
        self._check(trainer, due=(batch_idx + 1) % self.check_every_n_steps == 0)

    def _check(self, trainer: Trainer, due: bool) -> None:
        if not due or not self._previous_handlers or self._stopped:
            return
        signum, any_requeue_signal = self._agreed_signals(trainer)
        if not signum:
            return
        trained = (
            trainer.state.fn == TrainerFn.FITTING
            and not trainer.sanity_checking
            and self._first_step is not None
            and trainer.global_step > self._first_step
        )
        saved = self._save(trainer) if trained else None
        # For good: the handlers stay (_finish), so install() never clears it and no check runs again.
        self._stopped = True
        atexit.register(_ignore_signals_at_exit, tuple(self._previous_handlers))
        names = "/".join(signal.Signals(s).name for s in sorted(self._received)) or "a signal on another rank"
        done = f"saved {saved} at step {trainer.global_step}" if saved else "nothing trained since the run started, no save"
        rank_zero_info(f"{names}: {done}; stopping without further validation or checkpoints (resume with --ckpt_path last)")
        requeued = any_requeue_signal and self._requeue_signal is not None
        if requeued and trainer.is_global_zero:
            self._requeue_once()
            # The deadline's requeue may have run already; either way its status is known here. Rank 0's
            # exit status then says whether the job is back in the queue (srun reports the highest).
            requeued = self._requeue_status == 0
        raise Preempted(preempted_exit_status(signum, requeued))

    def _save(self, trainer: Trainer) -> str:
        path = self._checkpoint_path(trainer)
        trainer.save_checkpoint(path)
        return path

    def _agreed_signals(self, trainer: Trainer) -> tuple[int, bool]:
        """(the highest signal number any rank got, 0 for none; whether any rank got SLURM's requeue
        signal): a signal may reach only some ranks, and every rank must end the same way."""
        flags = [max(self._received, default=0), 1 if self._requeue_signal in self._received else 0]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            received = torch.tensor(flags, device=trainer.strategy.root_device)
            dist.all_reduce(received, op=dist.ReduceOp.MAX)
            flags = received.tolist()
        # One process agrees with itself: no tensor, so no copy to a GPU and no wait for it every few steps.
        signum, any_requeue_signal = flags
        if any_requeue_signal and self._requeues:
            self._start_requeue_deadline()  # the signal reached other ranks only: the deadline runs from now
        return int(signum), bool(any_requeue_signal)

    @staticmethod
    def _checkpoint_path(trainer: Trainer) -> str:
        callback = trainer.checkpoint_callback
        folder = callback.dirpath if isinstance(callback, ModelCheckpoint) and callback.dirpath else None
        folder = folder or os.path.join(trainer.default_root_dir, "checkpoints")
        return str(Path(folder) / f"{ModelCheckpoint.CHECKPOINT_NAME_LAST}{ModelCheckpoint.FILE_EXTENSION}")


def _ignore_signals_at_exit(signums: tuple[int, ...]) -> None:
    """Ignores ``signums`` for the rest of a pre-empted process's exit.

    After a requeue SLURM sends SIGTERM to every process of the job, and a rank may be exiting by then.
    Python's finalization puts the default action back for every signal with a Python handler, so a
    SIGTERM in its last moments killed a rank that had finished cleanly (exit status -15 where 0 was
    due). An ignored signal is left ignored. The run is over: nothing is left for a signal to stop, and
    a rank stuck at exit still gets SLURM's SIGKILL (``KillWait``) or Kubernetes' after its grace period.
    """
    report = sys.unraisablehook

    def drop_ignored_signal_reports(unraisable: Any) -> None:
        # A signal that arrives while the handler changes is dropped, as intended, but Python reports it
        # ("Signal 15 ignored due to race condition") through this hook.
        if not (isinstance(unraisable.exc_value, OSError) and "ignored due to race condition" in str(unraisable.exc_value)):
            report(unraisable)

    sys.unraisablehook = drop_ignored_signal_reports
    for signum in signums:
        signal.signal(signum, signal.SIG_IGN)


def preempted_exit_status(signum: int, requeued: bool) -> int:
    """The exit status of a run ended by a pre-emption signal: 0 once SLURM has the job back in its queue
    (it restarts it), otherwise 128 + the signal's number, as a process killed by it reports (143 for
    SIGTERM): the run did not finish, and a Kubernetes Job, torchrun or a retry loop must restart it with
    ``--ckpt_path last`` rather than count it done."""
    return 0 if requeued else 128 + signum


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
