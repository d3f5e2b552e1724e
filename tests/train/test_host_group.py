"""Exact AUC and predictions gathered in host memory, on a world whose default group carries no CPU
tensors, as under NCCL: here a gloo group made for CUDA tensors only ("cuda:gloo"), which refuses
CPU tensors exactly as NCCL does ("No backend type associated with device type cpu"). On 2 processes,
and on 1: torchmetrics gathers in a world of one too, which failed every validation of a 1-GPU fit on
an H200 until the host group was made for a single process as well."""

from __future__ import annotations

import os
import pickle
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torchmetrics.classification import BinaryAUROC

from app.train.callbacks import gather_predictions_to_rank_zero
from app.train.host_group import carries_host_tensors, host_process_group
from app.train.metrics import build_eval_metrics, sync_exact_auc_through
from tests.multiprocess import AGENT_STORE, rendezvous_port

NUM_ROWS = 301  # uneven over 2 ranks


def _rows() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    labels = (torch.rand(NUM_ROWS, generator=g) < 0.3).long()
    probabilities = torch.sigmoid(torch.randn(NUM_ROWS, generator=g) + labels)
    return torch.arange(NUM_ROWS), probabilities, labels


def _on_rank(rank: int, world_size: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **AGENT_STORE)  # the test hosts the store
    dist.init_process_group("cuda:gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    try:
        row_ids, probabilities, labels = (t[rank::world_size] for t in _rows())
        result: dict = {"world_carries_cpu": carries_host_tensors()}
        group = host_process_group()
        result["host_group_carries_cpu"] = group is not None and carries_host_tensors(group)

        metrics = build_eval_metrics("val/", "exact")
        sync_exact_auc_through(metrics, group)
        auc = metrics["auc"]
        auc.update(probabilities, labels)
        result["states_on_cpu"] = auc.compute_on_cpu and all(t.device.type == "cpu" for t in auc.preds + auc.target)
        result["auc"] = float(auc.compute())

        # Rows in a shuffled order on each rank; padding never reaches predict_step's outputs.
        order = torch.randperm(len(row_ids), generator=torch.Generator().manual_seed(rank))
        parts = [{"row_ids": row_ids[order][i::2], "probabilities": probabilities[order][i::2]} for i in range(2)]
        result["gathered"] = gather_predictions_to_rank_zero(parts, group)
        # Both ranks past their last collective before either tears gloo down: a rank whose peer closed
        # the sockets under a send still in flight aborts ("terminate called without an active exception").
        dist.barrier(group)
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))


@pytest.fixture(scope="module", params=[2, 1], ids=["2_processes", "1_process"])
def ranks(request, tmp_path_factory) -> list[dict]:
    world_size = request.param
    out_dir = tmp_path_factory.mktemp("host_group")
    with rendezvous_port() as port:
        mp.start_processes(_on_rank, args=(world_size, port, str(out_dir)), nprocs=world_size, start_method="forkserver")
    return [pickle.loads((out_dir / f"rank{rank}.pkl").read_bytes()) for rank in range(world_size)]


def test_a_gloo_group_is_made_where_the_default_group_carries_no_cpu_tensors(ranks):
    assert [r["world_carries_cpu"] for r in ranks] == [False] * len(ranks)
    assert [r["host_group_carries_cpu"] for r in ranks] == [True] * len(ranks)


def test_exact_auc_keeps_its_states_on_the_host_and_equals_one_process_auc(ranks):
    _, probabilities, labels = _rows()
    expected = float(BinaryAUROC()(probabilities, labels))
    assert [r["states_on_cpu"] for r in ranks] == [True] * len(ranks)
    assert [r["auc"] for r in ranks] == [expected] * len(ranks)  # exact, and the same on every rank


def test_predictions_reach_rank_zero_only_in_row_order(ranks):
    row_ids, probabilities, _ = _rows()
    gathered_ids, gathered_probabilities = ranks[0]["gathered"]
    assert torch.equal(gathered_ids, row_ids) and torch.equal(gathered_probabilities, probabilities)
    assert all(r["gathered"] is None for r in ranks[1:])  # the other ranks receive nothing


def test_one_process_needs_no_group_and_still_orders_rows():
    row_ids, probabilities, _ = _rows()
    assert host_process_group() is None  # not distributed
    parts = [{"row_ids": row_ids[1::2], "probabilities": probabilities[1::2]},
             {"row_ids": row_ids[::2], "probabilities": probabilities[::2]}]  # fmt: skip
    gathered_ids, gathered_probabilities = gather_predictions_to_rank_zero(parts)
    assert torch.equal(gathered_ids, row_ids) and torch.equal(gathered_probabilities, probabilities)
