"""One ``fit`` job at a time in a run folder: ``run.lock`` there names the job that owns it.

Two jobs writing one run folder break each other: rank 0 of each deletes every ``.last.ckpt.*``
folder its own ``last.ckpt`` link does not point to (app/checkpoint/format.py), which includes the
other job's save in progress, and ``--ckpt_path last`` resumes whichever job published last. So
``fit`` takes ``run.lock`` (:mod:`app.data.lock_file`: SLURM job id, host, pid, start time,
command) in ``trainer.default_root_dir``, and in each checkpoint folder outside it, before any work
starts, and gives it back when it ends. A second job is refused with one line naming the folder and
the holder. A holder that is gone is taken over: the same SLURM job requeued (same job id, higher
``SLURM_RESTART_COUNT``, on any host), or a process gone on this host. A holder on another host
cannot be probed: the message says to delete the file if that job has ended.

Global rank 0 takes it (the strategy, ``TorchRecStrategy.setup_environment``) and tells every rank
the outcome, so that all stop with the same line.
"""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch import Trainer

from app.data.lock_file import HolderLock

LOCK_FILE = "run.lock"


def run_folders(trainer: Trainer) -> list[Path]:
    """The folders a ``fit`` run writes: ``trainer.default_root_dir`` and the checkpoint folders not in it."""
    root = Path(trainer.default_root_dir).resolve()
    folders = [root]
    for callback in trainer.checkpoint_callbacks:
        dirpath = getattr(callback, "dirpath", None)
        if dirpath is not None:
            folder = Path(dirpath).resolve()
            if not folder.is_relative_to(root) and folder not in folders:
                folders.append(folder)
    return folders


class RunFolderLock:
    """The ``run.lock`` of each of ``folders``, taken together or not at all."""

    def __init__(self, folders: list[Path]) -> None:
        self.locks = [HolderLock(folder / LOCK_FILE) for folder in folders]

    def acquire(self) -> str | None:
        """Takes every folder's lock; returns None, or the line refusing the run (holding none then)."""
        for lock in self.locks:
            holder = lock.acquire()
            if holder is not None:
                self.release()
                return (
                    f"run folder {lock.path.parent} is in use by {holder.describe()} (its lock file {lock.path}): two "
                    "jobs in one run folder delete each other's checkpoints in progress and resume each other's; "
                    "set another trainer.default_root_dir, or if that job has ended (one on another host cannot be "
                    f"checked from here) delete {lock.path}"
                )
        return None

    def taken_over(self) -> list[str]:
        """A line per lock taken over from a holder that was gone, for the log."""
        return [
            f"run folder {lock.path.parent}: taken over from {lock.replaced.describe()}, which has ended"
            for lock in self.locks
            if lock.replaced is not None
        ]

    def release(self) -> None:
        for lock in self.locks:
            lock.release()
