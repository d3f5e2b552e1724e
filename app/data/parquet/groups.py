"""The group id of every row of an evaluation split, for GAUC: the cache's ``day_N_groups.npy``
files (written from the schema's group column), in day order, cut to the split's rows."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from app.data.parquet.reader import GROUPS_FILE


def split_groups(folder: Path, num_days: int, start: int, stop: int) -> np.ndarray:
    """Rows ``[start, stop)`` of the days' group ids (int64; 8 bytes per row in memory, on every rank:
    a row's group is looked up by its id in the split as its batch is evaluated)."""
    days = [np.load(folder / f"day_{day}_{GROUPS_FILE}", mmap_mode="r") for day in range(num_days)]
    return np.ascontiguousarray(np.concatenate(days)[start:stop], dtype=np.int64)
