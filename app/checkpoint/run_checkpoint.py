"""The checkpoint group (``--checkpoint.*``): Lightning's ModelCheckpoint, with ``last.ckpt`` where fit ended.

Lightning rewrites ``last.ckpt`` with every checkpoint it saves (each top-k checkpoint, each periodic
one) and, at the end of fit, only when the process has saved nothing at all. With a monitor and no
periodic saves, ``last.ckpt`` therefore stayed at the last validation that ranked in the top k in an
uninterrupted run, but moved to the final step in a resumed one: whether anything was saved is not
part of the state a resume restores, so a resumed run whose metric no longer improved saved
``last.ckpt`` at its end. Here the rule is the same for every run: at the end of fit ``last.ckpt`` holds
the state where fit ended (the last step, early stopping included), unless it already does or this
run trained no step (a pre-empted run ends through ``on_exception``: its save is SaveOnSignal's).

And ``last.ckpt`` is rewritten in place, never saved as ``last-v1.ckpt`` beside it: a folder holds one
run (app/checkpoint/run_folder.py), and ``--ckpt_path last`` reads exactly ``last.ckpt``.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint


class RunCheckpoint(ModelCheckpoint):
    """Lightning's ModelCheckpoint, with last.ckpt where fit ended (docs/checkpoints.md).

    The arguments are ModelCheckpoint's. With ``save_last: true``, ``last.ckpt`` is rewritten with
    every checkpoint saved and, at the end of fit, holds the state where fit ended; with
    ``save_last: link`` Lightning's own rule holds (a link to the newest checkpoint saved).
    """

    _started_at_step: int | None = None  # the global step fit started at (after a resume: the checkpoint's)

    @property
    def state_key(self) -> str:
        # Lightning keys a callback's state by its class name; ModelCheckpoint's, so that a checkpoint
        # restores the same state whichever of the two wrote it, and app/checkpoint/best.py finds it.
        return ModelCheckpoint.__qualname__ + super().state_key.removeprefix(type(self).__qualname__)

    def _save_last_checkpoint(self, trainer: Trainer, monitor_candidates: dict[str, Any]) -> None:
        # A folder holds one run (app/checkpoint/run_folder.py): a last.ckpt there is this run's, or the one
        # it continues, so it is rewritten, never versioned. Lightning writes last-v1.ckpt beside a last.ckpt
        # it did not name itself: in a run folder that was moved (or copied) and resumed, it restores no
        # last_model_path (the folder's path changed), and `--ckpt_path last` would then read the older one.
        # file_exists is rank 0's answer on every rank, so every rank saves under the same name.
        if self.save_last:
            path = self.format_checkpoint_name(monitor_candidates, self.CHECKPOINT_NAME_LAST)
            if path != self.last_model_path and self.file_exists(path, trainer):
                self.last_model_path = path
        super()._save_last_checkpoint(trainer, monitor_candidates)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Lightning's, then a fit checks that its checkpoint folder can be written, before the first step:
        every rank stops with rank 0's line rather than failing at the first save."""
        super().setup(trainer, pl_module, stage)
        if stage != "fit" or self.dirpath is None:
            return
        refusal = unwritable_folder(Path(self.dirpath)) if trainer.is_global_zero else None
        refusal = trainer.strategy.broadcast(refusal)
        if refusal is not None:
            raise ValueError(refusal)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._started_at_step = trainer.global_step

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.save_last is not True:
            super().on_train_end(trainer, pl_module)  # link (or none): Lightning's rule
            return
        trained = self._started_at_step is not None and trainer.global_step > self._started_at_step
        # Lightning's own skip: not fitting, fast_dev_run, sanity check, or already saved at this step.
        if trained and not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))


def unwritable_folder(folder: Path) -> str | None:
    """None if a file can be created in ``folder`` (made if missing), else the line saying why not. A real
    write, not ``os.access``: root passes that check on a read-only or immutable folder and then fails."""
    probe = folder / f".write-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        return f"checkpoint folder {folder} is not writable ({error.strerror or error}): set a writable checkpoint.dirpath"
    return None
