"""The train loader's position survives a checkpoint: a resumed epoch continues at the next batch."""

from __future__ import annotations

import numpy as np

from app.data.dataset import CriteoBatches
from app.data.loader import ResumableBatchLoader
from app.data.tsv import CriteoArrays


def _loader(num_workers: int = 0) -> ResumableBatchLoader:
    rows = np.arange(100)
    arrays = CriteoArrays(
        dense=np.repeat(rows[:, None], 13, axis=1).astype(np.float32),
        sparse=np.repeat(rows[:, None], 26, axis=1),
        labels=(rows % 2).astype(np.float32),
    )
    return ResumableBatchLoader(CriteoBatches(arrays, 8, 0, 1, shuffle=True, seed=1, drop_remainder=True), num_workers)


def _row_ids(batches) -> list[list[int]]:
    return [b.row_ids.tolist() for b in batches]


def test_resume_mid_epoch_continues_at_the_next_batch():
    reference = _loader()
    reference.sampler.set_epoch(3)
    full_epoch = _row_ids(reference)
    assert len(full_epoch) == 13

    interrupted = _loader()
    interrupted.sampler.set_epoch(3)
    iterator = iter(interrupted)
    first_five = _row_ids(next(iterator) for _ in range(5))
    state = interrupted.state_dict()
    assert state == {"epoch": 3, "next_batch": 5, "global_batch_size": 8}

    resumed = _loader(num_workers=1)  # a new process would build a new loader
    resumed.load_state_dict(state)
    rest = _row_ids(resumed)
    assert first_five + rest == full_epoch
    assert len(resumed) == 13  # Lightning counts the batches already done itself

    resumed.sampler.set_epoch(4)
    assert len(_row_ids(resumed)) == 13  # the next epoch is whole again


def test_a_checkpoint_after_the_last_batch_resumes_with_a_whole_epoch():
    loader = _loader()
    list(loader)
    state = loader.state_dict()
    assert state["next_batch"] == 13
    fresh = _loader()
    fresh.load_state_dict(state)
    fresh.sampler.set_epoch(1)
    assert len(list(fresh)) == 13
