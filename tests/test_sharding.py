"""The real `fit` path on 1 and 2 CPU processes (gloo): shards land where the plan says, and sharded
training gives the same model as unsharded training."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor

from app.data.batches import make_batch
from app.data.tsv import read_tsv
from multiprocess import DEMO_BEFORE_QUALITY_SETTINGS, run_on_ranks

TABLE_SIZE = 500
EMBEDDING_DIM = 8
NUM_TABLES = 26


def fit_args(sample: dict[str, Path], root: Path, sharding_type: str, batch_size_per_rank: int) -> list[str]:
    return [
        "fit",
        "--config", "configs/demo.yaml", *DEMO_BEFORE_QUALITY_SETTINGS,
        "--data.train", str(sample["train"]),
        "--data.val", str(sample["val"]),
        "--data.test", "null",
        "--data.predict", "null",
        "--data.batch_size", str(batch_size_per_rank),
        "--data.num_embeddings_per_feature", str(TABLE_SIZE),
        "--model.embedding_dim", str(EMBEDDING_DIM),
        "--model.dense_arch_layer_sizes", f"[16, {EMBEDDING_DIM}]",
        "--model.over_arch_layer_sizes", "[16, 1]",
        # Plain SGD for the MLPs: Adagrad's first step is lr * sign(gradient), which turns float
        # rounding noise in gradients that are truly ~0 into full-size steps and hides real differences.
        "--model.dense_optimizer", "sgd",
        "--model.dense_learning_rate", "0.1",
        "--trainer.strategy.sharding_types", f"[{sharding_type}]",
        "--trainer.max_epochs", "2",
        "--trainer.logger", "false",
        "--trainer.callbacks", "[]",  # drop the demo's checkpoint callback: nothing to save here
        "--trainer.enable_checkpointing", "false",
        "--trainer.enable_progress_bar", "false",
        "--trainer.default_root_dir", str(root),
        "--trainer.callbacks+=embedding_init.ReferenceEmbeddings",
    ]  # fmt: skip


def shards_and_predictions(cli) -> dict:
    """What one rank holds after fit, and its predictions for the whole validation file."""
    module = cli.trainer.lightning_module
    shards = {}
    for key, value in module.state_dict().items():
        if ".embedding_bags." in key:
            if isinstance(value, ShardedTensor):
                shards[key] = sorted(
                    (tuple(s.metadata.shard_offsets), tuple(s.metadata.shard_sizes)) for s in value.local_shards()
                )
            else:
                shards[key] = [((0, 0), tuple(value.shape))]  # data-parallel: a full replica
    arrays = read_tsv(cli.datamodule.specs["val"], [TABLE_SIZE] * NUM_TABLES)
    all_rows = np.arange(len(arrays))
    batch = make_batch(arrays.take(all_rows), all_rows)
    module.eval()
    with torch.no_grad():
        probabilities = torch.sigmoid(module(batch)).numpy()
    return {"shards": shards, "probabilities": probabilities, "global_step": cli.trainer.global_step}


@pytest.fixture(scope="module")
def unsharded(sample, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("unsharded")
    # One process with a 2x batch sees exactly the global batches of two processes.
    (result,) = run_on_ranks(1, fit_args(sample, root, "table_wise", 128), root, shards_and_predictions)
    return result


@pytest.mark.parametrize("sharding_type", ["table_wise", "column_wise", "data_parallel"])
def test_two_ranks_hold_their_shards_and_match_one_rank(sharding_type, sample, unsharded, tmp_path):
    ranks = run_on_ranks(2, fit_args(sample, tmp_path, sharding_type, 64), tmp_path, shards_and_predictions)

    assert [r["global_step"] for r in ranks] == [unsharded["global_step"]] * 2 == [24, 24]
    assert len(ranks[0]["shards"]) == NUM_TABLES
    for key in ranks[0]["shards"]:
        held = [rank["shards"][key] for rank in ranks]
        if sharding_type == "table_wise":
            # Each table lives whole on exactly one rank; the other rank holds nothing of it.
            assert sorted(len(h) for h in held) == [0, 1], key
            assert [s for h in held for s in h] == [((0, 0), (TABLE_SIZE, EMBEDDING_DIM))]
        elif sharding_type == "column_wise":
            # The columns of each table are split between the two ranks without overlap.
            columns = sorted((offsets[1], sizes[1]) for h in held for offsets, sizes in h)
            assert sum(width for _, width in columns) == EMBEDDING_DIM, key
            assert all(len(h) == 1 for h in held) or sorted(len(h) for h in held) == [0, 1]
            assert all(sizes[0] == TABLE_SIZE for h in held for _, sizes in h)
        else:
            assert held == [[((0, 0), (TABLE_SIZE, EMBEDDING_DIM))]] * 2
    if sharding_type == "table_wise":
        tables_per_rank = [len([k for k, h in r["shards"].items() if h]) for r in ranks]
        assert sorted(tables_per_rank) == [13, 13]

    # Both ranks see the same model, and it is the model one process trained.
    np.testing.assert_allclose(ranks[0]["probabilities"], ranks[1]["probabilities"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(ranks[0]["probabilities"], unsharded["probabilities"], rtol=0, atol=2e-5)
    # ... and training moved it: the comparison would be vacuous at the starting point.
    assert np.abs(unsharded["probabilities"] - 0.5).max() > 0.05
