"""Batches know their padding on the host: leaving it out is a slice, not a mask read back from a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from app.data.batches import PADDING_ROW_ID, CriteoBatch, make_batch
from app.data.source import RowBlock
from app.train.module import DLRMModule


def _block(num_rows: int) -> RowBlock:
    rng = np.random.default_rng(0)
    return RowBlock(
        dense=rng.random((num_rows, 13), dtype=np.float32),
        sparse=rng.integers(0, 10, (num_rows, 26)),
        labels=rng.integers(0, 2, num_rows).astype(np.float32),
    )


@pytest.mark.parametrize("row_ids", [[5, 6, 7, 8], [5, 6, -1, -1], [-1]])
def test_the_real_rows_are_a_slice_that_selects_what_the_mask_selects(row_ids):
    batch = make_batch(_block(len(row_ids)), np.array(row_ids))
    assert isinstance(batch.valid_rows, slice)
    mask = batch.row_ids != PADDING_ROW_ID
    assert torch.equal(batch.labels[batch.valid_rows], batch.labels[mask])
    assert batch.row_ids[batch.valid_rows].tolist() == [r for r in row_ids if r != PADDING_ROW_ID]
    # Carried through the copies a loader and the strategy make.
    module = DLRMModule(num_embeddings_per_feature=10, embedding_dim=8, dense_arch_layer_sizes=[8],
                        over_arch_layer_sizes=[8, 1])  # fmt: skip
    moved = module.transfer_batch_to_device(batch, torch.device("cpu"), 0)
    assert isinstance(moved, CriteoBatch) and moved.num_real_rows == batch.num_real_rows == mask.sum()


def test_padding_before_a_real_row_is_refused():
    with pytest.raises(ValueError, match="padding rows .* must come after every real row"):
        make_batch(_block(3), np.array([1, -1, 2]))


def test_a_batch_built_without_the_count_falls_back_to_the_mask():
    built = make_batch(_block(3), np.array([1, 2, -1]))
    batch = CriteoBatch(built.dense_features, built.sparse_features, built.labels, built.row_ids)
    assert torch.equal(batch.valid_rows, torch.tensor([True, True, False]))
