"""Rows per rank and step: every row once in evaluation, equal step counts everywhere."""

from __future__ import annotations

import numpy as np
import pytest

from app.data.batches import PADDING_ROW_ID
from app.data.dataset import CriteoBatches, EpochBatchSampler
from app.data.partition import num_batches, rank_slice
from app.data.tsv import CriteoArrays


def _arrays(num_rows: int) -> CriteoArrays:
    rows = np.arange(num_rows)
    return CriteoArrays(
        dense=np.repeat(rows[:, None], 13, axis=1).astype(np.float32),
        sparse=np.repeat(rows[:, None], 26, axis=1).astype(np.int64),
        labels=(rows % 2).astype(np.float32),
    )


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("num_rows", [1, 2, 7, 24, 25, 100])
def test_evaluation_visits_every_row_exactly_once(world_size, num_rows):
    arrays = _arrays(num_rows)
    ranks = [CriteoBatches(arrays, 4, rank, world_size, shuffle=False, seed=0, drop_remainder=False) for rank in range(world_size)]
    assert len({len(r) for r in ranks}) == 1  # same number of steps on every rank
    seen = []
    for rank in ranks:
        for index in range(len(rank)):
            batch = rank[(0, index)]
            assert batch.sparse_features.stride() == len(batch.labels)
            ids = batch.row_ids.numpy()
            real = ids[ids != PADDING_ROW_ID]
            # the features really are the rows the ids name
            np.testing.assert_array_equal(batch.dense_features.numpy()[ids != PADDING_ROW_ID, 0], real)
            seen.extend(real.tolist())
    assert sorted(seen) == list(range(num_rows))


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_training_shuffles_per_epoch_and_drops_fewer_than_world_size_rows(world_size):
    num_rows, batch_size = 103, 8
    arrays = _arrays(num_rows)
    ranks = [CriteoBatches(arrays, batch_size, rank, world_size, shuffle=True, seed=5, drop_remainder=True) for rank in range(world_size)]
    epochs = []
    for epoch in (0, 1):
        rows = [ranks[r][(epoch, i)].row_ids.tolist() for i in range(len(ranks[0])) for r in range(world_size)]
        flat = [row for batch in rows for row in batch]
        dropped = num_rows % (batch_size * world_size) % world_size
        assert len(flat) == len(set(flat)) == num_rows - dropped
        assert len({len(ranks[r][(epoch, len(ranks[0]) - 1)].row_ids) for r in range(world_size)}) == 1
        epochs.append(flat)
    assert epochs[0] != epochs[1]  # a new order each epoch
    again = CriteoBatches(arrays, batch_size, 0, world_size, shuffle=True, seed=5, drop_remainder=True)
    assert again[(1, 0)].row_ids.tolist() == ranks[0][(1, 0)].row_ids.tolist()  # deterministic


def test_global_batches_do_not_depend_on_world_size():
    """Step k of 2 ranks x 4 rows is step k of 1 rank x 8 rows: what makes runs comparable."""
    arrays = _arrays(50)
    one = CriteoBatches(arrays, 8, 0, 1, shuffle=True, seed=3, drop_remainder=True)
    two = [CriteoBatches(arrays, 4, rank, 2, shuffle=True, seed=3, drop_remainder=True) for rank in range(2)]
    assert len(one) == len(two[0]) == 7
    for step in range(len(one)):
        split = two[0][(2, step)].row_ids.tolist() + two[1][(2, step)].row_ids.tolist()
        assert split == one[(2, step)].row_ids.tolist()


def test_counts_and_slices():
    assert num_batches(10, 2, 2, drop_remainder=True) == 3  # 4 + 4 + (2 split as 1 + 1)
    assert num_batches(9, 2, 2, drop_remainder=True) == 2  # the 9th row cannot be split: dropped
    assert num_batches(9, 2, 2, drop_remainder=False) == 3
    assert rank_slice(2, 9, 2, 2, 0, drop_remainder=False) == (8, 9)
    assert rank_slice(2, 9, 2, 2, 1, drop_remainder=False) == (9, 9)  # padding step
    with pytest.raises(IndexError):
        rank_slice(3, 9, 2, 2, 0, drop_remainder=False)


def test_sampler_follows_the_epoch_lightning_sets():
    sampler = EpochBatchSampler(3)
    sampler.set_epoch(4)
    assert list(sampler) == [(4, 0), (4, 1), (4, 2)]
    assert len(sampler) == 3


class _MappedRows:
    """A memory-mapped-like source: shuffling must permute whole global batches, not rows."""

    def __init__(self, arrays: CriteoArrays) -> None:
        self.arrays = arrays

    def __len__(self) -> int:
        return len(self.arrays)

    @property
    def in_memory(self) -> bool:
        return False

    def take(self, rows):
        return self.arrays.take(rows)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_memory_mapped_sources_shuffle_global_batches_and_keep_every_row_once(world_size):
    batch_size, num_rows = 4, 4 * 3 * 9 + 5  # 9 full global batches for 3 ranks, and a short one
    source = _MappedRows(_arrays(num_rows))
    ranks = [CriteoBatches(source, batch_size, r, world_size, shuffle=True, seed=2, drop_remainder=True) for r in range(world_size)]
    orders = []
    for epoch in (0, 1):
        steps = [[ranks[r][(epoch, i)].row_ids.tolist() for r in range(world_size)] for i in range(len(ranks[0]))]
        flat = [row for step in steps for rows in step for row in rows]
        dropped = num_rows % (batch_size * world_size) % world_size
        assert sorted(flat) == sorted(set(flat)) and len(flat) == num_rows - dropped
        for step in steps:  # each step is one contiguous run of rows: reads stay sequential
            rows = [row for rows in step for row in rows]
            assert rows == list(range(rows[0], rows[0] + len(rows)))
        orders.append([step[0][0] for step in steps])
    assert orders[0] != orders[1]
