"""A callback that records what each training step trained on and what each evaluation saw.

For the pipeline tests: per rank, the loss and row ids of every training step in order (from the
batch Lightning hands ``on_train_batch_end``, which a pipelined step sets to the batch it trained),
and the row ids of every validation pass. And a stepped clock for the throughput callback.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer


class TrainingProbe(Callback):
    """Keeps ``steps``: (epoch, global_step, loss, row ids) per training step, and ``validations``:
    (global_step, row ids, val/logloss) per validation pass during fit."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, int, float, list[int]]] = []
        self.validations: list[list] = []

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.steps.append((trainer.current_epoch, trainer.global_step, float(loss), batch.row_ids.tolist()))

    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.state.fn == "fit":
            self.validations.append([trainer.global_step, [], None])

    def on_validation_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if self.validations and trainer.state.fn == "fit":
            self.validations[-1][1].extend(batch.row_ids.tolist())

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.validations and trainer.state.fn == "fit":
            self.validations[-1][2] = float(trainer.callback_metrics["val/logloss"])


class StepClock(Callback):
    """Makes the app's throughput callback read a clock that advances one second per training step.

    Its ``train/samples_per_sec`` is then exactly the rows trained per step, all ranks together: a
    value the test can check, where the wall clock's is only ever positive.
    """

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        import app.train.callbacks

        # The name `time` of that module only: Lightning's own timing keeps the real clock.
        app.train.callbacks.time = SimpleNamespace(perf_counter=lambda: float(trainer.global_step))
