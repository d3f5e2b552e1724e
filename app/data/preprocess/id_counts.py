"""Exact counts of every distinct (feature, raw id) pair, merged from per-chunk ``np.unique``."""

from __future__ import annotations

import numpy as np

from app.criteo import NUM_SPARSE

# A (feature, id) pair as one int64 key, feature in the high bits: one np.unique covers all 26.
FEATURE_OFFSETS = np.arange(NUM_SPARSE, dtype=np.int64) << 32


class IdCounter:
    """Every distinct (feature, raw id) pair seen, with how often: exact, in sorted int64 keys.

    Chunks are reduced with np.unique and merged into the total only once the pending ones hold as
    many keys as the total, so each key is re-sorted a logarithmic number of times, not per chunk.
    """

    MIN_MERGE_KEYS = 1 << 22

    def __init__(self) -> None:
        self.keys = np.empty(0, dtype=np.int64)
        self.counts = np.empty(0, dtype=np.int64)
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []
        self._pending_keys = 0

    def add_ids(self, ids: np.ndarray) -> None:
        """Count a chunk of raw ids, (rows, 26) in [0, 2**32).

        One uint32 sort of the transposed chunk covers the 26 features, cheaper than np.unique over
        int64 (feature, id) keys; the keys come out sorted by feature, then id, as np.unique's would.
        """
        columns = np.ascontiguousarray(np.asarray(ids).T, dtype=np.uint32)  # raw ids are 32-bit: exact
        columns.sort(axis=1)
        rows = columns.shape[1]
        if rows == 0:
            return
        first = np.empty(columns.shape, dtype=bool)
        first[:, 0] = True
        np.not_equal(columns[:, 1:], columns[:, :-1], out=first[:, 1:])
        keys, counts = [], []
        for j in range(NUM_SPARSE):
            starts = np.flatnonzero(first[j])
            keys.append(columns[j, starts].astype(np.int64) + FEATURE_OFFSETS[j])
            counts.append(np.diff(starts, append=rows))
        self.add_counts(np.concatenate(keys), np.concatenate(counts))

    def add_counts(self, keys: np.ndarray, counts: np.ndarray) -> None:
        """Add sorted unique keys with their counts (e.g. another counter's)."""
        self._pending.append((keys, counts.astype(np.int64, copy=False)))
        self._pending_keys += keys.size
        if self._pending_keys >= max(self.keys.size, self.MIN_MERGE_KEYS):
            self.merge()

    def merge(self) -> "IdCounter":
        """Fold the pending chunks into ``keys``/``counts``; returns self."""
        if not self._pending:
            return self
        keys = np.concatenate([self.keys] + [k for k, _ in self._pending])
        counts = np.concatenate([self.counts] + [c for _, c in self._pending])
        self._pending, self._pending_keys = [], 0
        order = np.argsort(keys, kind="stable")
        keys, counts = keys[order], counts[order]
        starts = np.flatnonzero(np.concatenate(([True], keys[1:] != keys[:-1])))
        self.keys, self.counts = keys[starts], np.add.reduceat(counts, starts) if keys.size else counts
        return self

    def per_feature(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """``(sorted raw ids int64, counts)`` of each of the 26 features."""
        self.merge()
        bounds = np.searchsorted(self.keys, np.append(FEATURE_OFFSETS, np.int64(NUM_SPARSE) << 32))
        return [
            (self.keys[a:b] - FEATURE_OFFSETS[j], self.counts[a:b])
            for j, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))
        ]

    def npz_members(self) -> dict[str, np.ndarray]:
        """``ids_j`` (uint32) and ``counts_j`` per feature: how a pass saves its counts for the vocabulary."""
        members = {}
        for j, (ids, counts) in enumerate(self.per_feature()):
            members[f"ids_{j}"], members[f"counts_{j}"] = ids.astype(np.uint32), counts
        return members


class DistinctIds:
    """The distinct raw ids of each feature (no counts): what a day's stats need, about 3x cheaper
    than :class:`IdCounter`, because one uint32 sort of the transposed chunk covers all 26 features.

    Each chunk's distinct ids are kept per feature and merged into the total only once the pending
    ones hold as many ids as the total (each id re-sorted a logarithmic number of times).
    """

    def __init__(self) -> None:
        self.ids = [np.empty(0, dtype=np.uint32) for _ in range(NUM_SPARSE)]
        self._pending: list[list[np.ndarray]] = [[] for _ in range(NUM_SPARSE)]
        self._pending_ids = np.zeros(NUM_SPARSE, dtype=np.int64)

    def add_ids(self, ids: np.ndarray) -> None:
        """Add a chunk of raw ids, (rows, 26) in [0, 2**32)."""
        if ids.shape[0] == 0:
            return
        columns = np.ascontiguousarray(ids.T, dtype=np.uint32)  # raw ids are 32-bit: exact
        columns.sort(axis=1)
        first = np.empty(columns.shape, dtype=bool)
        first[:, 0] = True
        np.not_equal(columns[:, 1:], columns[:, :-1], out=first[:, 1:])
        for j in range(NUM_SPARSE):
            self._add_distinct(j, columns[j][first[j]])

    def add_feature_ids(self, feature: int, ids: np.ndarray) -> None:
        """Add raw ids of one feature beside the rows' (a Parquet list column's ids, any number a row)."""
        self._add_distinct(feature, np.unique(np.asarray(ids, dtype=np.uint32)))

    def _add_distinct(self, j: int, distinct: np.ndarray) -> None:
        self._pending[j].append(distinct)
        self._pending_ids[j] += distinct.size
        if self._pending_ids[j] >= max(self.ids[j].size, 1 << 20):
            self._merge(j)

    def _merge(self, j: int) -> None:
        if self._pending[j]:
            self.ids[j] = np.unique(np.concatenate([self.ids[j], *self._pending[j]]))
            self._pending[j], self._pending_ids[j] = [], 0

    def per_feature(self) -> list[np.ndarray]:
        """The sorted distinct raw ids (uint32) of each of the 26 features."""
        for j in range(NUM_SPARSE):
            self._merge(j)
        return self.ids
