"""Evaluation on a GPU: the click logit in float32 under bf16 autocast, the exact AUC's states in host
memory, and evaluation steps that never make the host wait for the device (torch's sync debug mode
turns any synchronising call into an error)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchmetrics.classification import BinaryAUROC

from app.data.batches import make_batch
from app.data.source import RowBlock
from app.model.dlrm import build_dlrm
from app.train.metrics import build_eval_metrics

# Skipped without a usable GPU by tests/gpu/conftest.py, with the reason, as every check of this folder.
pytestmark = pytest.mark.gpu


def _predictions(num_rows: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    labels = (torch.rand(num_rows, generator=g) < 0.25).long()
    return torch.sigmoid(torch.randn(num_rows, generator=g) + labels).to(device), labels.to(device)


def test_the_click_logit_is_float32_under_cuda_bf16_autocast():
    torch.manual_seed(0)
    model = build_dlrm(
        interaction="dot", embedding_dim=8, num_embeddings_per_feature=[10] * 26,
        dense_arch_layer_sizes=[16, 8], over_arch_layer_sizes=[16, 16, 1], embedding_device="cuda",
    ).cuda()  # fmt: skip
    rng = np.random.default_rng(0)
    block = RowBlock(dense=rng.random((64, 13), dtype=np.float32), sparse=rng.integers(0, 10, (64, 26)),
                     labels=rng.integers(0, 2, 64).astype(np.float32))  # fmt: skip
    batch = make_batch(block, np.arange(64)).to(torch.device("cuda"))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(batch.dense_features, batch.sparse_features)
    assert logits.dtype == torch.float32


def test_exact_auc_keeps_its_states_in_host_memory():
    probabilities, labels = _predictions(10_000, "cuda")
    metrics = build_eval_metrics("val/", "exact").to("cuda")
    for part in range(4):
        metrics.update(probabilities[part::4], labels[part::4])
    auc = metrics["auc"]
    assert {t.device.type for t in auc.preds + auc.target} == {"cpu"}
    assert float(metrics.compute()["val/auc"]) == float(BinaryAUROC()(probabilities.cpu(), labels.cpu()))


@pytest.mark.parametrize("mode", ["binned"])  # exact copies each batch to the host: one wait per step by design
def test_an_evaluation_step_never_waits_for_the_device(mode):
    rng = np.random.default_rng(0)
    block = RowBlock(dense=rng.random((8, 13), dtype=np.float32), sparse=rng.integers(0, 10, (8, 26)),
                     labels=rng.integers(0, 2, 8).astype(np.float32))  # fmt: skip
    row_ids = np.array([0, 1, 2, 3, 4, 5, -1, -1])  # padding rows, as in a last batch
    pinned = make_batch(block, row_ids).pin_memory()
    probabilities, labels = _predictions(1_000, "cuda")
    metrics = build_eval_metrics("val/", mode, 1_000).to("cuda")
    metrics.update(probabilities, labels)  # the first update settles the collection's compute groups (reads back)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        batch = pinned.to(torch.device("cuda"), non_blocking=True)  # what DLRMModule.transfer_batch_to_device asks
        valid = batch.valid_rows
        metrics.update(torch.sigmoid(batch.dense_features[:, 0])[valid], batch.labels[valid].long())
        metrics.update(probabilities, labels)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert float(metrics.compute()["val/auc"]) > 0.5
