"""GAUC and the precision-recall AUC against a direct computation from their definitions, on one
process and on 2 and 3 gloo ranks whose rows split groups between them."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from app.train.metrics import GroupAUC, group_auc, precision_recall_auc
from tests.multiprocess import rendezvous_port, run_folder


def pairwise_auc(p: np.ndarray, y: np.ndarray) -> float:
    """The share of (positive, negative) pairs the positive scores higher, ties counting half."""
    positive, negative = p[y == 1][:, None], p[y == 0][None, :]
    return float(((positive > negative) + 0.5 * (positive == negative)).mean())


def direct_gauc(p: np.ndarray, y: np.ndarray, g: np.ndarray) -> float:
    weighted, rows = 0.0, 0
    for group in np.unique(g):
        mine = g == group
        if 0 < y[mine].sum() < mine.sum():
            weighted += pairwise_auc(p[mine], y[mine]) * mine.sum()
            rows += mine.sum()
    return weighted / rows


def direct_average_precision(p: np.ndarray, y: np.ndarray) -> float:
    """Sum over distinct thresholds, highest first, of (recall gained) x (precision there)."""
    total, previous_recall = 0.0, 0.0
    for threshold in np.unique(p)[::-1]:
        chosen = p >= threshold
        recall = y[chosen].sum() / y.sum()
        total += (recall - previous_recall) * y[chosen].mean()
        previous_recall = recall
    return float(total)


def rows(seed: int = 7, num_rows: int = 600) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows of 40 groups (one all-negative, one all-positive), predictions rounded so that ties occur,
    sorted by group so that contiguous rank slices cut groups in two."""
    rng = np.random.default_rng(seed)
    groups = np.sort(rng.integers(0, 40, num_rows)) * 1_000_003  # large, sparse ids, as hashed user ids are
    p = rng.random(num_rows).round(2).astype(np.float32)
    y = (rng.random(num_rows) < 0.3 + 0.4 * p).astype(np.int64)
    y[groups == groups[0]] = 0
    y[groups == groups[-1]] = 1
    return p, y, groups


def test_group_auc_equals_the_direct_computation_and_skips_one_label_groups():
    p, y, g = rows()
    assert group_auc(p, y, g) == pytest.approx(direct_gauc(p, y, g), abs=1e-12)
    assert group_auc(p, y, np.zeros_like(g)) == pytest.approx(pairwise_auc(p, y), abs=1e-12)  # one group: the AUC
    assert np.isnan(group_auc(p, np.zeros_like(y), g))  # no group with both labels
    shuffled = np.random.default_rng(1).permutation(len(p))
    assert group_auc(p[shuffled], y[shuffled], g[shuffled]) == group_auc(p, y, g)


def test_precision_recall_auc_equals_average_precision_by_hand():
    p, y, _ = rows()
    metric = precision_recall_auc()
    metric.update(torch.from_numpy(p), torch.from_numpy(y))
    assert float(metric.compute()) == pytest.approx(direct_average_precision(p, y), abs=1e-6)


def _rank_metrics(rank: int, world_size: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True")
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        p, y, g = (torch.from_numpy(a) for a in rows())
        bounds = np.linspace(0, len(p), world_size + 1).astype(int) + np.r_[0, [13] * (world_size - 1), 0]  # unequal shares
        mine = slice(int(bounds[rank]), int(bounds[rank + 1]))
        gauc, pr_auc = GroupAUC(), precision_recall_auc()
        half = (mine.start + mine.stop) // 2
        for part in (slice(mine.start, half), slice(half, mine.stop)):  # two batches per rank
            gauc.update(p[part], y[part], g[part])
            pr_auc.update(p[part], y[part])
        result = {"gauc": float(gauc.compute()), "pr_auc": float(pr_auc.compute()), "groups": set(g[mine].tolist())}
        Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_gauc_and_pr_auc_are_exact_across_ranks_that_split_groups(world_size, tmp_path):
    out = run_folder(tmp_path, "metrics")
    with rendezvous_port() as port:
        mp.start_processes(_rank_metrics, args=(world_size, port, str(out)), nprocs=world_size, start_method="forkserver")
    results = [pickle.loads((out / f"rank{rank}.pkl").read_bytes()) for rank in range(world_size)]
    p, y, g = rows()
    if world_size > 1:  # the case under test: a group with rows on two ranks
        assert results[0]["groups"] & results[1]["groups"]
    for result in results:  # every rank computes the value of all rows
        assert result["gauc"] == pytest.approx(direct_gauc(p, y, g), abs=1e-6)
        assert result["pr_auc"] == pytest.approx(direct_average_precision(p, y), abs=1e-6)


def _gauc_inputs(cli) -> dict:
    """The validation rows this rank evaluated (ids, probabilities, labels) and the logged metrics."""
    from app.data.batches import PADDING_ROW_ID

    module, datamodule = cli.trainer.lightning_module, cli.datamodule
    module.eval()
    mine, padding = [], 0
    with torch.no_grad():
        for batch in datamodule.val_dataloader():
            valid = batch.valid_rows
            mine.append((batch.row_ids[valid].numpy(), torch.sigmoid(module(batch))[valid].numpy(), batch.labels[valid].numpy()))
            padding += int((batch.row_ids == PADDING_ROW_ID).sum())
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (mine, padding))
    row_ids, p, y = (np.concatenate([part[i] for rank, _ in gathered for part in rank]) for i in range(3))
    return {"logged": {k: float(v) for k, v in cli.trainer.callback_metrics.items()}, "row_ids": row_ids, "p": p, "y": y,
            "groups": datamodule.eval_groups["val"], "padding": [count for _, count in gathered]}  # fmt: skip


USERS = np.arange(257) * 7_919 % 23 + 1_000  # 23 users, each with rows on both ranks


def test_validation_logs_the_gauc_of_the_parquet_group_column_over_2_ranks(tmp_path):
    from app.data.synthetic import write_synthetic_criteo
    from app.data.to_parquet import to_parquet
    from tests.multiprocess import DEMO_BEFORE_QUALITY_SETTINGS, run_on_ranks

    write_synthetic_criteo(tmp_path / "val.tsv", num_rows=257, seed=12)  # 2 ranks x 64: the last step pads rank 1
    to_parquet(str(tmp_path / "val.tsv"), str(tmp_path / "pq"), row_group_rows=100)
    table = pq.read_table(tmp_path / "pq" / "val.parquet")  # with a user column: groups spread over both ranks
    pq.write_table(table.append_column("user", pa.array(USERS)), tmp_path / "pq" / "val.parquet", row_group_size=100)
    args = [
        "validate", "--config", "configs/demo.yaml", *DEMO_BEFORE_QUALITY_SETTINGS, "--data.train", "null",
        "--data.val", str(tmp_path / "pq" / "val.parquet"), "--data.format", "parquet", "--data.schema.group", "user",
        "--data.test", "null", "--data.predict", "null", "--data.batch_size", "64", "--data.cache_dir", str(tmp_path / "cache"),
        "--data.num_embeddings_per_feature", "500", "--model.embedding_dim", "8",
        "--model.dense_arch_layer_sizes", "[16, 8]", "--model.over_arch_layer_sizes", "[16, 1]",
        "--trainer.logger", "false", "--trainer.callbacks", "[]", "--trainer.enable_progress_bar", "false",
        "--trainer.default_root_dir", str(tmp_path),
    ]  # fmt: skip
    result = run_on_ranks(2, args, tmp_path, _gauc_inputs)[0]
    assert result["padding"] == [0, 1]
    order = np.argsort(result["row_ids"])
    assert result["row_ids"][order].tolist() == list(range(257))  # every real row once
    assert np.array_equal(result["groups"], USERS)
    expected = direct_gauc(result["p"][order].astype(np.float64), result["y"][order], USERS)
    assert result["logged"]["val/gauc"] == pytest.approx(expected, abs=1e-6)
    # The precision-recall AUC logged beside it: of every row, gathered from both ranks.
    assert result["logged"]["val/pr_auc"] == pytest.approx(direct_average_precision(result["p"][order], result["y"][order]), abs=1e-6)
