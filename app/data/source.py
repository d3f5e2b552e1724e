"""What every Criteo format provides to the batch builder: rows addressed by index.

A source is the rows of one split, whatever the files hold (raw TSV parsed into memory, TorchRec's
NumPy day files or MLPerf's multi-hot files, both memory-mapped). ``take(rows)`` gathers a block of
rows with a few vectorised reads; the dataset decides which rows form each rank's batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from app.criteo import NUM_SPARSE


def check_table_sizes(num_embeddings_per_feature: Sequence[int]) -> np.ndarray:
    """The 26 table sizes as int64 moduli for the categorical ids, or a ValueError."""
    sizes = np.asarray(list(num_embeddings_per_feature))
    if sizes.shape != (NUM_SPARSE,) or not np.issubdtype(sizes.dtype, np.integer) or (sizes <= 0).any():
        raise ValueError(
            f"num_embeddings_per_feature must be {NUM_SPARSE} positive table sizes, "
            f"got {list(num_embeddings_per_feature)!r}"
        )
    return sizes.astype(np.int64)


@dataclass
class RowBlock:
    """Rows ready to become a batch.

    dense: float32 (B, 13), already transformed.
    sparse: int64 ids, already taken modulo the table sizes: either one (B, 26) matrix (one id per
        row and feature, as in raw Criteo), or a list of 26 arrays (B, m_j) for multi-hot features
        with m_j ids per row (MLPerf DLRMv2), pooled into one bag per row and feature; in that list a
        jagged feature (a Parquet list column) is a tuple (ids per row (B,), the ids row after row).
    labels: float32 (B,), 0/1; -1 for unlabelled rows.
    feature_names: the categorical features' names, one per sparse column; None: Criteo's 26.
    """

    dense: np.ndarray
    sparse: np.ndarray | list[np.ndarray]
    labels: np.ndarray
    feature_names: tuple[str, ...] | None = None

    def __len__(self) -> int:
        return int(self.labels.shape[0])


class RowSource(Protocol):
    """The rows of one split."""

    def __len__(self) -> int:
        """Number of rows."""

    def take(self, rows: np.ndarray) -> RowBlock:
        """The rows at the given int64 positions, in that order."""

    @property
    def in_memory(self) -> bool:
        """True when any row is as cheap to read as any other, so a full row shuffle costs nothing.

        Memory-mapped sources say False: shuffling then permutes whole global batches, which keeps
        every read contiguous (and the permutation small) for billions of rows.
        """
