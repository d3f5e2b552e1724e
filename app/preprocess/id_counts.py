"""Exact counts of every distinct (feature, raw id) pair, merged from per-chunk ``np.unique``."""

from __future__ import annotations

import numpy as np

from app.data.tsv import NUM_SPARSE

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
        """Count a chunk of raw ids, int64 (rows, 26) in [0, 2**32)."""
        keys, counts = np.unique((ids + FEATURE_OFFSETS).ravel(), return_counts=True)
        self.add_counts(keys, counts)

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
