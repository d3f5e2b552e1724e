"""Training batches in TorchRec's layout, built from Criteo arrays without per-row Python.

A batch holds B rows: ``dense_features`` (B, 13) float32, ``sparse_features`` a KeyedJaggedTensor
with the 26 categorical features (one id per row and feature for raw Criteo, a bag of ids per row
and feature for multi-hot data; a data schema's own features, by their names), ``labels`` (B,)
float32, and ``row_ids`` (B,) int64: each row's index in its split, or -1 for a padding row that
only keeps the ranks' batch counts equal and must be ignored by metrics and predictions. Padding
rows come last, and their number is known on the host when the batch is built: leaving them out is
a slice, which on a GPU needs no copy of a mask back to the host (a boolean mask index does).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torchrec.datasets.criteo import DEFAULT_CAT_NAMES
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from app.data.source import RowBlock

PADDING_ROW_ID = -1


@dataclass
class CriteoBatch(Batch):
    """TorchRec's ``Batch`` plus the row ids that let evaluation skip padding and predictions be joined."""

    row_ids: torch.Tensor
    # Rows [0, num_real_rows) are data, the rest padding; None: not known, found from row_ids.
    num_real_rows: int | None = None

    def to(self, device: torch.device, non_blocking: bool = False) -> "CriteoBatch":
        return CriteoBatch(
            dense_features=self.dense_features.to(device=device, non_blocking=non_blocking),
            sparse_features=self.sparse_features.to(device=device, non_blocking=non_blocking),
            labels=self.labels.to(device=device, non_blocking=non_blocking),
            row_ids=self.row_ids.to(device=device, non_blocking=non_blocking),
            num_real_rows=self.num_real_rows,
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
            num_real_rows=self.num_real_rows,
        )

    @property
    def valid_rows(self) -> slice | torch.Tensor:
        """Index of the rows that are real data, not padding: ``tensor[batch.valid_rows]``.

        A slice when the batch knows its padding (built by ``make_batch``), else a boolean mask (B,).
        """
        if self.num_real_rows is None:
            return self.row_ids != PADDING_ROW_ID
        return slice(0, self.num_real_rows)


def make_batch(block: RowBlock, row_ids: np.ndarray) -> CriteoBatch:
    """Builds one batch from a block of rows; ``row_ids`` (B,) are their ids in the split (-1 for
    padding, after every real row)."""
    num_real_rows = int(np.count_nonzero(row_ids != PADDING_ROW_ID))
    if (row_ids[num_real_rows:] != PADDING_ROW_ID).any():
        raise ValueError("padding rows (row id -1) must come after every real row of a batch")
    keys = list(DEFAULT_CAT_NAMES if block.feature_names is None else block.feature_names)
    values, lengths = _jagged_ids(block.sparse, len(block), keys)
    sparse_features = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths)
    return CriteoBatch(
        dense_features=torch.from_numpy(np.ascontiguousarray(block.dense, dtype=np.float32)),
        sparse_features=sparse_features,
        labels=torch.from_numpy(np.ascontiguousarray(block.labels, dtype=np.float32)),
        row_ids=torch.from_numpy(np.ascontiguousarray(row_ids, dtype=np.int64)),
        num_real_rows=num_real_rows,
    )


def _jagged_ids(
    sparse: np.ndarray | list[np.ndarray], batch_size: int, keys: list[str]
) -> tuple[torch.Tensor, torch.Tensor]:
    """KeyedJaggedTensor values and lengths; values are feature-major: all rows of cat_0, then cat_1, ..."""
    if isinstance(sparse, np.ndarray):  # one id per row and feature
        if sparse.shape != (batch_size, len(keys)):
            raise ValueError(f"expected sparse ids of shape ({batch_size}, {len(keys)}), got {sparse.shape}")
        values = torch.from_numpy(np.ascontiguousarray(sparse.T, dtype=np.int64)).reshape(-1)
        return values, torch.ones(sparse.size, dtype=torch.int32)
    if len(sparse) != len(keys):
        raise ValueError(f"expected {len(keys)} multi-hot features, got {len(sparse)}")
    # Feature j holds m_j ids per row, row after row: its (B, m_j) array flattened in row order; or
    # it is jagged, (ids per row (B,), the ids row after row): a list feature of own data (docs/own-data.md).
    values, lengths = [], []
    for ids in sparse:
        if isinstance(ids, tuple):
            lengths.append(np.asarray(ids[0], dtype=np.int32))
            values.append(ids[1])
        else:
            lengths.append(np.full(batch_size, ids.shape[1], dtype=np.int32))
            values.append(ids.reshape(-1))
    return torch.from_numpy(np.concatenate(values).astype(np.int64, copy=False)), torch.from_numpy(np.concatenate(lengths))
