"""Cached days with list (multi-valued) features: the NumPy days' rows plus, for each list feature,
``day_N_list_<j>_lengths.npy`` (ids per row) and ``day_N_list_<j>_ids.npy`` (the ids, row after row),
memory-mapped. A batch's list feature is jagged: each row's own ids, taken modulo the table's size."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from app.criteo import NUM_SPARSE
from app.data.numpy_days import NumpyDaysSource
from app.data.parquet.reader import LIST_IDS_FILE, LIST_LENGTHS_FILE
from app.data.source import RowBlock


class JaggedDaysSource(NumpyDaysSource):
    """A :class:`NumpyDaysSource` whose ``list_features`` (model feature indices) are read from their
    jagged files; ``take`` gives ``sparse`` as 26 entries: ``(rows, 1)`` ids, or ``(lengths, ids)``.
    Each list feature keeps its rows' id offsets in memory (8 bytes a row), the ids stay mapped."""

    def __init__(
        self,
        prefixes: Sequence[str | os.PathLike],
        num_embeddings_per_feature: Sequence[int],
        start_row: int = 0,
        stop_row: int | None = None,
        list_features: Sequence[int] = (),
    ) -> None:
        self.list_features = [int(j) for j in list_features]
        self._lists: list[dict[int, tuple[np.ndarray, np.ndarray]]] = []  # per day: j -> (offsets, ids)
        super().__init__(prefixes, num_embeddings_per_feature, start_row, stop_row)
        self._init_args["list_features"] = self.list_features

    def _open(self, prefix: Path) -> int:
        rows = super()._open(prefix)
        day = {}
        for j in self.list_features:
            lengths = np.load(f"{prefix}_{LIST_LENGTHS_FILE.format(j)}", mmap_mode="r")
            ids = np.load(f"{prefix}_{LIST_IDS_FILE.format(j)}", mmap_mode="r")
            offsets = np.concatenate(([0], np.cumsum(lengths, dtype=np.int64)))
            if lengths.shape != (rows,) or offsets[-1] != ids.shape[0]:
                raise ValueError(f"{prefix}: the list files of feature {j} do not match the day's {rows} rows")
            day[j] = (offsets, ids)
        self._lists.append(day)
        return rows

    def take(self, rows: np.ndarray) -> RowBlock:
        block = super().take(rows)
        rows = np.asarray(rows, dtype=np.int64).reshape(-1) + self.start_row
        day = np.searchsorted(self.day_starts, rows, side="right") - 1
        local = rows - self.day_starts[day]
        sparse: list = [block.sparse[:, j : j + 1] for j in range(NUM_SPARSE)]
        for j in self.list_features:
            sparse[j] = self._jagged(j, day, local)
        return RowBlock(block.dense, sparse, block.labels)

    def _jagged(self, j: int, day: np.ndarray, local: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Feature ``j``'s (ids per row int32, the ids int64 modulo its table) of the given rows, in order."""
        lengths = np.empty(day.size, dtype=np.int64)
        starts = np.empty(day.size, dtype=np.int64)
        for d in np.unique(day).tolist():
            mine = day == d
            offsets = self._lists[d][j][0]
            starts[mine], lengths[mine] = offsets[local[mine]], offsets[local[mine] + 1] - offsets[local[mine]]
        out_starts = np.cumsum(lengths) - lengths
        ids = np.empty(int(lengths.sum()), dtype=np.int64)
        for d in np.unique(day).tolist():
            mine = np.flatnonzero(day == d)
            counts = lengths[mine]
            within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
            stored = self._lists[d][j][1][np.repeat(starts[mine], counts) + within]
            ids[np.repeat(out_starts[mine], counts) + within] = stored.view(np.uint32) % self.moduli[j]
        return lengths.astype(np.int32), ids
