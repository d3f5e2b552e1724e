"""The app's side of the benchmark: the real LightningModule, TorchRecStrategy and Trainer, on one rank.

The Trainer is built as ``python -m app fit`` builds it (the app's samples/s and save-on-signal callbacks included),
minus what a benchmark must not time: loggers, checkpoints, the progress bar (unless a variant asks for
it: ``progress_bar_refresh_rate``) and validation.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import LightningDataModule, Trainer
from lightning.pytorch.callbacks import TQDMProgressBar

from app.bench.data import RandomDataModule, pins_batches
from app.bench.dataset import open_dataset
from app.bench.measure import StepClock, StepClockCallback
from app.bench.settings import PROGRESS_BAR_KEY, BenchSpec, app_precision, split_variant
from app.bench.trained_batches import TrainedBatches, TrainedBatchesCallback
from app.checkpoint.preemption import SaveOnSignal
from app.distributed.strategy import TorchRecStrategy
from app.train.callbacks import SamplesPerSecond
from app.train.module import DLRMModule


def run_app(
    spec: BenchSpec, model_overrides: dict[str, Any], clock: StepClock, trained: TrainedBatches, rank: int,
    device: torch.device,
) -> dict[str, Any]:
    """Trains ``spec.total_steps`` steps, timed by ``clock``, each batch trained added to ``trained``;
    returns the module and the plan for the report. ``model_overrides``: a variant's settings (model
    settings, and strategy settings under its ``strategy`` key)."""
    model_settings, strategy_settings = split_variant(model_overrides)
    refresh_rate = model_overrides.get(PROGRESS_BAR_KEY, 0)
    progress_bar = [TQDMProgressBar(refresh_rate=refresh_rate)] if refresh_rate else []
    module = DLRMModule(**{**spec.model_args(), **model_settings})
    trainer = Trainer(
        accelerator=spec.run.accelerator,
        devices=spec.run.world_size,
        strategy=TorchRecStrategy(**{**spec.strategy, **strategy_settings}),
        max_steps=spec.total_steps,
        default_root_dir=spec.run.output_dir,  # the strategy writes the plan it used there
        max_epochs=-1,
        precision=app_precision(spec.run, model_overrides),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=bool(progress_bar),
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[SamplesPerSecond(), SaveOnSignal(), StepClockCallback(clock), TrainedBatchesCallback(trained), *progress_bar],
    )
    trainer.fit(module, datamodule=_data_module(spec, rank, device))
    if trainer.global_step != spec.total_steps:
        raise RuntimeError(f"the app trained {trainer.global_step} steps instead of {spec.total_steps}")
    return {"plan": trainer.strategy.sharding_plan, "module": module}


def _data_module(spec: BenchSpec, rank: int, device: torch.device) -> LightningDataModule:
    """The app's own Criteo data module for a dataset (Lightning prepares and sets it up; with
    ``max_epochs=-1``, ``max_steps`` runs through as many epochs as it takes; its loader pins batches
    on GPU machines), else random batches, pinned for a GPU run."""
    if spec.dataset is not None:
        return open_dataset(spec.dataset)
    return RandomDataModule(spec.data, spec.total_steps, spec.run.seed + rank, pins_batches(device))
