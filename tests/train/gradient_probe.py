"""A callback that records, after each training step, the largest gradient left on the module's parameters.

For the pipeline tests: with ``trainer.gradient_clip_algorithm = value`` the largest gradient after a
clipped step is exactly the clip value, in the plain loop and in a pipelined step alike.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer


class GradientProbe(Callback):
    """Keeps ``largest``: per training step, the largest absolute gradient of any parameter (None if none has one)."""

    def __init__(self) -> None:
        self.largest: list[float | None] = []

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        grads = [p.grad.abs().max() for p in pl_module.parameters() if isinstance(p.grad, torch.Tensor)]
        self.largest.append(float(torch.stack(grads).max()) if grads else None)
