"""Which rows each rank gets in each step: one global batch per step, split across the ranks.

Step k covers rows ``[k * G, (k + 1) * G)`` of the (optionally shuffled) row order, with
``G = batch_size_per_rank * world_size``, and rank r takes the r-th slice of it. So a run on W
processes sees exactly the global batches that a 1-process run with a W times larger batch sees,
which is what makes results comparable across world sizes. Every rank gets the same number of
batches, as the sharded model's collectives require.

The last global batch is usually short:
    * training (``drop_remainder=True``) splits it evenly and drops the fewer than W rows left over;
    * evaluation (``drop_remainder=False``) keeps every row: slices differ by at most one row, and a
      rank whose slice is empty gets one padding row (row id -1) to keep step counts equal.
"""

from __future__ import annotations

import math


def num_batches(num_rows: int, batch_size_per_rank: int, world_size: int, drop_remainder: bool) -> int:
    """Number of steps (batches per rank) for ``num_rows`` rows."""
    global_batch = batch_size_per_rank * world_size
    num_full, remainder = divmod(num_rows, global_batch)
    if drop_remainder:
        return num_full + int(remainder // world_size > 0)
    return math.ceil(num_rows / global_batch)


def rank_slice(
    batch_index: int,
    num_rows: int,
    batch_size_per_rank: int,
    world_size: int,
    rank: int,
    drop_remainder: bool,
) -> tuple[int, int]:
    """The ``[start, stop)`` positions in the row order that ``rank`` takes in step ``batch_index``.

    ``stop == start`` means the rank has no real row in this step (evaluation only).
    """
    global_batch = batch_size_per_rank * world_size
    batch_start = batch_index * global_batch
    rows_in_batch = min(global_batch, num_rows - batch_start)
    if rows_in_batch <= 0:
        raise IndexError(f"batch {batch_index} is past the end of {num_rows} rows")
    if rows_in_batch == global_batch:
        start = batch_start + rank * batch_size_per_rank
        return start, start + batch_size_per_rank
    per_rank, extra = divmod(rows_in_batch, world_size)
    if drop_remainder:
        start = batch_start + rank * per_rank
        return start, start + per_rank
    start = batch_start + rank * per_rank + min(rank, extra)
    return start, start + per_rank + int(rank < extra)
