"""Callbacks the CLI always installs: training throughput, and a predictions file."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import BasePredictionWriter

from app.data.datamodule import CriteoDataModule
from app.train.host_group import host_process_group
from app.train.log_steps import metrics_written_after_this_batch
from app.train.predictions_file import PredictionsRecord, write_predictions


class SamplesPerSecond(Callback):
    """Logs ``train/samples_per_sec`` (all ranks together) to the loggers and the progress bar.

    Lightning's ThroughputMonitor writes to the loggers only, not to the progress bar, hence this.
    Logged on the steps whose metrics Lightning writes (every ``trainer.log_every_n_steps``).

    Args:
        window_batches: number of recent batches the rate is averaged over.
    """

    def __init__(self, window_batches: int = 20) -> None:
        self.window_batches = window_batches
        self._start_time_s = 0.0
        self._samples = 0
        self._batches = 0

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._restart()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._samples += batch.labels.numel() * trainer.world_size
        self._batches += 1
        elapsed_s = time.perf_counter() - self._start_time_s
        # Only where Lightning writes step metrics: a log call costs ~1 ms (app/train/log_steps.py).
        if elapsed_s > 0 and metrics_written_after_this_batch(trainer):
            pl_module.log(
                "train/samples_per_sec",
                self._samples / elapsed_s,
                prog_bar=True,
                on_step=True,
                batch_size=batch.labels.numel(),  # required when training_step takes dataloader_iter
            )
        if self._batches >= self.window_batches:
            self._restart()

    def _restart(self) -> None:
        self._start_time_s = time.perf_counter()
        self._samples = 0
        self._batches = 0


class PredictionWriter(BasePredictionWriter):
    """Writes ``predictions.tsv`` (row id, click probability), rows in input order, from all ranks, and
    ``predictions.json`` beside it (the checkpoint, its global step, the inputs, the row count); the log
    line says what a file it replaces held (app/train/predictions_file.py).

    Rank 0 writes: the other ranks send it their rows through host memory (a gloo group beside
    NCCL, app/train/host_group.py) and keep nothing of the others'.

    Args:
        output_dir: folder of the predictions file (default: the run folder of a checkpoint in a run's
            ``checkpoints/``, else ``trainer.default_root_dir``).
    """

    def __init__(self, output_dir: str | None = None) -> None:
        super().__init__(write_interval="epoch")
        self.output_dir = output_dir
        self._group: dist.ProcessGroup | None = None
        self._checkpoint_step: int | None = None  # the global step of the checkpoint loaded for this predict

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage == "predict":  # every rank, before the loop: where a collective may start
            self._group = host_process_group()
            self._checkpoint_step = None

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        # Lightning calls it for every stage (after setup) with the checkpoint's metadata; an exported model
        # file has no callback states, so Lightning does not, and its step stays unknown.
        self._checkpoint_step = checkpoint.get("global_step")

    def write_on_epoch_end(
        self, trainer: Trainer, pl_module: LightningModule, predictions: Any, batch_indices: Any
    ) -> None:
        gathered = gather_predictions_to_rank_zero(predictions, self._group)
        if gathered is None:
            return
        row_ids, probabilities = gathered
        inputs = trainer.datamodule.specs.get("predict") if isinstance(trainer.datamodule, CriteoDataModule) else None
        record = PredictionsRecord(
            checkpoint=None if trainer.ckpt_path is None else str(trainer.ckpt_path),
            global_step=self._checkpoint_step,
            inputs=[] if inputs is None else [str(p) for p in ([inputs] if isinstance(inputs, str) else inputs)],
            rows=len(row_ids),
        )
        keys = trainer.datamodule.predict_keys() if isinstance(trainer.datamodule, CriteoDataModule) else None
        print(write_predictions(Path(self.output_dir or trainer.default_root_dir), row_ids, probabilities, record, keys))


def gather_predictions_to_rank_zero(
    predictions: list[dict[str, torch.Tensor]], group: dist.ProcessGroup | None = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Every rank's ``predict_step`` outputs (row ids and probabilities, padding already left out),
    on rank 0 in row-id order; None on the other ranks.

    ``group`` must carry CPU tensors (None: the default group); collective over all ranks.
    """
    row_ids = torch.cat([p["row_ids"] for p in predictions]).cpu()
    probabilities = torch.cat([p["probabilities"] for p in predictions]).cpu()
    if dist.is_initialized() and dist.get_world_size() > 1:
        rank_zero = dist.get_rank() == 0
        gathered: list[Any] | None = [None] * dist.get_world_size() if rank_zero else None
        dist.gather_object((row_ids, probabilities), gathered, dst=0, group=group)
        if gathered is None:
            return None
        row_ids = torch.cat([g[0] for g in gathered])
        probabilities = torch.cat([g[1] for g in gathered])
    order = torch.argsort(row_ids)
    return row_ids[order], probabilities[order]
