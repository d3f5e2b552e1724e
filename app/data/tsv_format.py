"""What a raw Criteo TSV row is and what reading one gives: the field layout (label, I1..I13,
C1..C26), the reader's options, its result (:class:`CriteoArrays`) and its error
(:class:`CriteoFormatError`). Every other ``tsv_*`` module builds on these; the reader itself is
:mod:`app.data.tsv`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from app.data.source import NUM_DENSE, NUM_SPARSE, RowBlock

LABELLED_FIELDS = 1 + NUM_DENSE + NUM_SPARSE  # 40
UNLABELLED_FIELDS = NUM_DENSE + NUM_SPARSE  # 39

DENSE_NAMES = tuple(f"I{i}" for i in range(1, NUM_DENSE + 1))
SPARSE_NAMES = tuple(f"C{i}" for i in range(1, NUM_SPARSE + 1))

OnBadRows = Literal["error", "skip"]
DenseTransform = Literal["log1p", "log_plus_3"]
ON_BAD_ROWS: tuple[str, ...] = ("error", "skip")
DENSE_TRANSFORMS: tuple[str, ...] = ("log1p", "log_plus_3")

_TAB, _LF, _CR, _MINUS = 9, 10, 13, 45


class CriteoFormatError(ValueError):
    """A malformed Criteo TSV input. The message starts with ``"<file>:<line>: "`` (1-based)."""


@dataclass
class CriteoArrays:
    """Parsed rows, ready for a model.

    dense: float32 (N, 13), the transformed integer features (``dense_transform``): by default
        ``log(max(x, 0) + 1)``; missing -> raw value 0 before the transform.
    sparse: int64 (N, 26), the 32-bit hex id modulo ``num_embeddings_per_feature[j]``; missing -> 0.
    labels: float32 (N,), 0/1; -1 for rows of an unlabelled (39-field) file.
    num_bad_rows: malformed lines dropped by ``on_bad_rows="skip"`` (always 0 with "error").
    first_bad_row: the error message (``"<file>:<line>: ..."``) of the first dropped line, if any.
    """

    dense: np.ndarray
    sparse: np.ndarray
    labels: np.ndarray
    num_bad_rows: int = 0
    first_bad_row: str | None = None

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @property
    def in_memory(self) -> bool:
        return True

    def take(self, rows: np.ndarray) -> RowBlock:
        """The rows at the given positions (the RowSource interface)."""
        return RowBlock(self.dense[rows], self.sparse[rows], self.labels[rows])

    @staticmethod
    def concat(parts: Sequence["CriteoArrays"]) -> "CriteoArrays":
        """Concatenate row-wise, in the given order (an empty sequence gives zero rows).

        The bad-row counts add up; the first part's ``first_bad_row`` example is kept.
        """
        if len(parts) == 1:
            return parts[0]
        if not parts:
            return _empty_arrays(0)
        return CriteoArrays(
            dense=np.concatenate([p.dense for p in parts]),
            sparse=np.concatenate([p.sparse for p in parts]),
            labels=np.concatenate([p.labels for p in parts]),
            num_bad_rows=sum(p.num_bad_rows for p in parts),
            first_bad_row=next((p.first_bad_row for p in parts if p.first_bad_row), None),
        )


def _empty_arrays(num_rows: int) -> CriteoArrays:
    """Uninitialised arrays for ``num_rows`` rows."""
    return CriteoArrays(
        dense=np.empty((num_rows, NUM_DENSE), np.float32),
        sparse=np.empty((num_rows, NUM_SPARSE), np.int64),
        labels=np.empty((num_rows,), np.float32),
    )


def _columns(arrays: CriteoArrays) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return arrays.dense, arrays.sparse, arrays.labels
