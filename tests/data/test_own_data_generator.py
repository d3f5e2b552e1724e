"""data/make_own_data.py plants what its docstring says: the click probabilities of the rows it writes
are its truth's on the written columns, and that truth has pairwise interactions (a user's taste for
an item) on top of the per-id effects, which the additive truth lacks."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from app.data.synthetic import rank_auc
from app.quality.planted import recorded_truth
from app.train.metrics import group_auc


@pytest.fixture(scope="module")
def generator():
    spec = importlib.util.spec_from_file_location("make_own_data", Path("data/make_own_data.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _logits(generator, kind: str, users: list[int], items: list[int]) -> np.ndarray:
    """The truth's logits of every (user, item) pair, all else equal: device 0, price 10, hour 12,
    recent items the first 3 of the user's favourites; (users, items)."""
    truth = generator.world(0)
    user, item = (ids.ravel() for ids in np.meshgrid(users, items, indexing="ij"))
    recent = truth["favourites"][user][:, : generator.MAX_RECENT_ITEMS]
    count = user.size
    return generator.true_logits(
        truth, kind, user, item, np.zeros(count, int), np.full(count, 10.0), np.full(count, 12), recent, np.full(count, 3)
    ).reshape(len(users), len(items))


def test_the_fm_truth_adds_a_user_by_item_interaction_that_the_additive_truth_lacks(generator):
    users, items = [0, 1, 7], [3, 40, 999]
    for kind in ("additive", "fm"):
        logits = _logits(generator, kind, users, items)
        # How much more user u likes item i than item 0, against user 0: zero for every pair when the
        # logit is a sum of per-column effects.
        double_difference = logits - logits[:, :1] - logits[:1, :] + logits[:1, :1]
        if kind == "additive":
            assert np.abs(double_difference).max() < 1e-12
            continue
        # With the pairs: <v_user - v_user0, (v_item + v_category) - (v_item0 + v_category0)>, the
        # only pairs in which both the user and the item change (the recent items are the user's own,
        # and they pair with the item: that part moves with the user too).
        truth = generator.world(0)
        item_side = truth["item_factors"][items] + truth["category_factors"][truth["category_of_item"][items]]
        recent = truth["item_factors"][truth["favourites"][users][:, :3]].mean(axis=1)
        user_side = truth["user_factors"][users] + recent
        expected = (user_side - user_side[:1]) @ (item_side - item_side[:1]).T
        np.testing.assert_allclose(double_difference, expected, rtol=0, atol=1e-12)
        assert np.abs(double_difference).max() > 0.1  # an interaction of the logit's own scale


def test_the_written_rows_are_the_truths_inputs_and_the_file_records_its_ceiling(generator, tmp_path):
    truth = generator.world(0)
    table, clicked, probability, user = generator.rows(truth, 2_000, seed=5, kind="fm")
    columns = table.to_pydict()
    item = np.array(columns["item_id"]) - generator.ITEM_ID_OFFSET
    lengths = np.array([len(items) for items in columns["recent_items"]])
    recent = np.zeros((len(item), generator.MAX_RECENT_ITEMS), dtype=np.int64)
    for row, items in enumerate(columns["recent_items"]):
        recent[row, : len(items)] = np.array(items) - generator.ITEM_ID_OFFSET
    assert lengths.max() == generator.MAX_RECENT_ITEMS and (lengths == 0).any()
    assert all(set(recent[r, : lengths[r]]) <= set(truth["favourites"][user[r]]) for r in range(len(item)))
    assert columns["user_id"] == [f"user-{u}" for u in user]
    device = np.array([generator.DEVICES.index(d) for d in columns["device"]])
    price = np.array([np.nan if p is None else p for p in columns["price"]])
    logged = ~np.isnan(price)  # a missing price is one the log lost: the truth still saw it
    assert 0.9 < logged.mean() < 1
    logits = generator.true_logits(truth, "fm", user, item, device, price, np.array(columns["hour"]), recent, lengths)
    np.testing.assert_allclose(probability[logged], 1 / (1 + np.exp(-logits[logged])), rtol=1e-12)
    assert columns["clicked"] == clicked.tolist()

    summary = generator.write_files(tmp_path, 1_000, seed=0)
    val = tmp_path / "val.parquet"
    assert recorded_truth([val]) == (summary["val"]["planted_truth_auc"], summary["val"]["planted_truth_gauc"])
    assert recorded_truth([val, val]) == recorded_truth([val], part="first_half") == (None, None)
    assert "clicked" not in pq.read_schema(tmp_path / "predict.parquet").names
    _, clicked, probability, user = generator.rows(truth, 200, seed=2, kind="fm")  # val's rows: seed + 2
    assert summary["val"]["planted_truth_auc"] == rank_auc(probability, clicked)
    assert summary["val"]["planted_truth_gauc"] == group_auc(probability, clicked, user)
