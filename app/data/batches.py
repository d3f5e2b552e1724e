"""Training batches in TorchRec's layout, built from Criteo arrays without per-row Python.

A batch holds B rows: ``dense_features`` (B, 13) float32, ``sparse_features`` a KeyedJaggedTensor
with the 26 categorical features (one id per row and feature for one-hot Criteo), ``labels`` (B,)
float32, and ``row_ids`` (B,) int64: each row's index in its split, or -1 for a padding row that
only keeps the ranks' batch counts equal and must be ignored by metrics and predictions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torchrec.datasets.criteo import DEFAULT_CAT_NAMES
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

PADDING_ROW_ID = -1


@dataclass
class CriteoBatch(Batch):
    """TorchRec's ``Batch`` plus the row ids that let evaluation skip padding and predictions be joined."""

    row_ids: torch.Tensor

    def to(self, device: torch.device, non_blocking: bool = False) -> "CriteoBatch":
        return CriteoBatch(
            dense_features=self.dense_features.to(device=device, non_blocking=non_blocking),
            sparse_features=self.sparse_features.to(device=device, non_blocking=non_blocking),
            labels=self.labels.to(device=device, non_blocking=non_blocking),
            row_ids=self.row_ids.to(device=device, non_blocking=non_blocking),
        )

    def record_stream(self, stream: torch.Stream) -> None:
        super().record_stream(stream)
        self.row_ids.record_stream(stream)

    def pin_memory(self) -> "CriteoBatch":
        return CriteoBatch(
            dense_features=self.dense_features.pin_memory(),
            sparse_features=self.sparse_features.pin_memory(),
            labels=self.labels.pin_memory(),
            row_ids=self.row_ids.pin_memory(),
        )

    @property
    def valid_rows(self) -> torch.Tensor:
        """Boolean mask (B,) of the rows that are real data, not padding."""
        return self.row_ids != PADDING_ROW_ID


def make_batch(dense: np.ndarray, sparse: np.ndarray, labels: np.ndarray, row_ids: np.ndarray) -> CriteoBatch:
    """Builds one batch from already-selected rows: dense (B, 13), sparse (B, 26) int ids, labels (B,)."""
    batch_size, num_sparse = sparse.shape
    if num_sparse != len(DEFAULT_CAT_NAMES):
        raise ValueError(f"expected {len(DEFAULT_CAT_NAMES)} sparse columns, got {num_sparse}")
    # KeyedJaggedTensor values are feature-major: all rows of cat_0, then all rows of cat_1, ...
    values = torch.from_numpy(np.ascontiguousarray(sparse.T, dtype=np.int64)).reshape(-1)
    sparse_features = KeyedJaggedTensor.from_lengths_sync(
        keys=DEFAULT_CAT_NAMES,
        values=values,
        lengths=torch.ones(batch_size * num_sparse, dtype=torch.int32),
    )
    return CriteoBatch(
        dense_features=torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32)),
        sparse_features=sparse_features,
        labels=torch.from_numpy(np.ascontiguousarray(labels, dtype=np.float32)),
        row_ids=torch.from_numpy(np.ascontiguousarray(row_ids, dtype=np.int64)),
    )
