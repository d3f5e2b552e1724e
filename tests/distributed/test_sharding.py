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
from tests.multiprocess import DEMO_BEFORE_QUALITY_SETTINGS, run_on_ranks

TABLE_SIZE = 500
EMBEDDING_DIM = 8
NUM_TABLES = 26
# TorchRec cuts column-wise shards no narrower than MIN_CW_DIM = 128 columns unless a table's
# constraints set min_partition (torchrec/distributed/planner/constants.py:19, sharding_plan.py
# _get_block_size_for_cw_shard): tables of 8 columns stay whole under column_wise. 256 columns: two shards.
TORCHREC_MIN_COLUMN_SHARD = 128
WIDE_EMBEDDING_DIM = 2 * TORCHREC_MIN_COLUMN_SHARD


def fit_args(
    sample: dict[str, Path], root: Path, sharding_type: str, batch_size_per_rank: int, embedding_dim: int = EMBEDDING_DIM
) -> list[str]:
    return [
        "fit",
        "--config", "configs/demo.yaml", *DEMO_BEFORE_QUALITY_SETTINGS,
        "--data.train", str(sample["train"]),
        "--data.val", str(sample["val"]),
        "--data.test", "null",
        "--data.predict", "null",
        "--data.batch_size", str(batch_size_per_rank),
        "--data.num_embeddings_per_feature", str(TABLE_SIZE),
        "--model.embedding_dim", str(embedding_dim),
        "--model.dense_arch_layer_sizes", f"[16, {embedding_dim}]",
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
        "--trainer.callbacks+=tests.embedding_init.ReferenceEmbeddings",
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
def unsharded(sample, tmp_path_factory) -> dict[int, dict]:
    """One process with a 2x batch (it sees exactly the global batches of two processes), per
    embedding width, run when a test first needs it. Wide tables are cut into the same column shards
    there (both on the one rank): row-wise Adagrad keeps one accumulator per row and column shard, so
    a whole table would train differently."""
    runs: dict[int, dict] = {}

    def run(embedding_dim: int) -> dict:
        if embedding_dim not in runs:
            root = tmp_path_factory.mktemp(f"unsharded_{embedding_dim}")
            sharding_type = "table_wise" if embedding_dim == EMBEDDING_DIM else "column_wise"
            args = fit_args(sample, root, sharding_type, 128, embedding_dim)
            (runs[embedding_dim],) = run_on_ranks(1, args, root, shards_and_predictions)
        return runs[embedding_dim]

    return run


@pytest.mark.parametrize(
    ("sharding_type", "embedding_dim"),
    [("table_wise", EMBEDDING_DIM), ("column_wise", WIDE_EMBEDDING_DIM), ("data_parallel", EMBEDDING_DIM)],
)
def test_two_ranks_hold_their_shards_and_match_one_rank(sharding_type, embedding_dim, sample, unsharded, tmp_path):
    reference = unsharded(embedding_dim)
    ranks = run_on_ranks(2, fit_args(sample, tmp_path, sharding_type, 64, embedding_dim), tmp_path, shards_and_predictions)

    assert [r["global_step"] for r in ranks] == [reference["global_step"]] * 2 == [24, 24]
    assert len(ranks[0]["shards"]) == NUM_TABLES
    for key in ranks[0]["shards"]:
        held = [rank["shards"][key] for rank in ranks]
        if sharding_type == "table_wise":
            # Each table lives whole on exactly one rank; the other rank holds nothing of it.
            assert sorted(len(h) for h in held) == [0, 1], key
            assert [s for h in held for s in h] == [((0, 0), (TABLE_SIZE, EMBEDDING_DIM))]
        elif sharding_type == "column_wise":
            # Every table is cut into two shards of 128 columns, all rows each, without overlap.
            shards = sorted(s for h in held for s in h)
            assert shards == [((0, 0), (TABLE_SIZE, 128)), ((0, 128), (TABLE_SIZE, 128))], key
            assert reference["shards"][key] == shards  # the one process holds both
        else:
            assert held == [[((0, 0), (TABLE_SIZE, EMBEDDING_DIM))]] * 2
    if sharding_type in ("table_wise", "column_wise"):
        # Balanced: 13 tables or 26 column shards on each rank.
        shards_per_rank = [sum(len(h) for h in r["shards"].values()) for r in ranks]
        assert shards_per_rank == ([13, 13] if sharding_type == "table_wise" else [26, 26])

    # Both ranks see the same model, and it is the model one process trained.
    np.testing.assert_allclose(ranks[0]["probabilities"], ranks[1]["probabilities"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(ranks[0]["probabilities"], reference["probabilities"], rtol=0, atol=2e-5)
    # ... and training moved it: the comparison would be vacuous at the starting point.
    assert np.abs(reference["probabilities"] - 0.5).max() > 0.05
