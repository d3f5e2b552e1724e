"""What a rank trained on, step by step: the rows of each step's batch, and a checksum of the batches.

The rows make samples/s exact where a step's batch is short (the last batch of a dataset's epoch).
The checksum covers each batch's row ids (its rows' positions in the split) and the order of the
batches; the summary compares the checksums of the two sides (``same_batches``) instead of assuming
that they read the same data. For random batches the row ids are only positions in the batch, so
there it checks the number of batches; their contents are equal by construction (one generator
seed per rank on both sides).

Both are taken where the batch already is (on the GPU for the app, whose batch reaches the callback
there) with shape metadata and a few tensor ops, never a host sync, so that nothing breaks a
pipeline's overlap; the checksum is read once, after training.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from app.data.batches import CriteoBatch

# Arithmetic modulo a prime below 2**31: every product below stays within int64 on any device.
_PRIME = 2_147_483_647
_BASE = 1_000_003  # of the polynomial over the batches: order matters


class TrainedBatches:
    """The batches trained, in order: rows per step and a running checksum."""

    def __init__(self) -> None:
        self.rows_per_step: list[int] = []
        self._checksum: torch.Tensor | None = None

    def add(self, batch: CriteoBatch) -> None:
        self.rows_per_step.append(batch.labels.numel())
        ids = batch.row_ids.to(torch.int64).remainder(_PRIME)  # padding rows (-1) too
        positions = torch.arange(1, ids.numel() + 1, device=ids.device, dtype=torch.int64)
        term = (ids * positions).remainder(_PRIME).sum().remainder(_PRIME) + 1
        self._checksum = term if self._checksum is None else (self._checksum * _BASE + term).remainder(_PRIME)

    def recording(self, batches: Iterator[CriteoBatch]) -> Iterator[CriteoBatch]:
        """``batches``, each added as it is handed out (for a loop that trains every batch it pulls)."""
        for batch in batches:
            self.add(batch)
            yield batch

    def checksum(self) -> str:
        """``batches:checksum``, read after training (the one host sync)."""
        value = 0 if self._checksum is None else int(self._checksum.item())
        return f"{len(self.rows_per_step)}:{value:08x}"


class TrainedBatchesCallback(Callback):
    """Adds the batch each training step trained (Lightning's batch-end hook; with the app's
    pipeline, the batch trained, not the one just fetched)."""

    def __init__(self, trained: TrainedBatches) -> None:
        self.trained = trained

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.trained.add(batch)
