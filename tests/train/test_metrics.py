"""Evaluation metrics: exact across ranks, and the constant-memory (binned) AUC within its stated error."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torchmetrics.classification import BinaryAUROC, BinaryAveragePrecision

from app.data.synthetic import rank_auc, write_synthetic_criteo
from app.data.batches import PADDING_ROW_ID
from app.train.metrics import BinnedAUROC, Calibration, LogLoss, build_eval_metrics, check_exact_auc_memory, sync_exact_auc_through
from tests.multiprocess import DEMO_BEFORE_QUALITY_SETTINGS, run_on_ranks


def _predictions(num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    labels = (torch.rand(num_rows, generator=g) < 0.25).long()
    return torch.sigmoid(torch.randn(num_rows, generator=g) * 1.5 - 1.5 + labels * 1.2), labels


def _max_error(probabilities: np.ndarray, labels: np.ndarray, num_thresholds: int) -> float:
    """1/2 * sum over bins of positives x negatives / (P x N): pairs within a bin are the only ones
    the binned AUC may order wrongly, and it counts each as half right."""
    bins = np.searchsorted(torch.linspace(0, 1, num_thresholds).numpy(), probabilities, side="right")
    positives = np.bincount(bins[labels == 1], minlength=num_thresholds + 1)
    negatives = np.bincount(bins[labels == 0], minlength=num_thresholds + 1)
    return 0.5 * float((positives * negatives).sum()) / (positives.sum() * negatives.sum())


def test_binned_auc_counts_exactly_what_torchmetrics_counts():
    probabilities, labels = _predictions(5_000)
    probabilities[:4] = torch.tensor([0.0, 0.5, 1.0, 0.25])  # on thresholds and at both ends
    ours, theirs = BinnedAUROC(thresholds=101), BinaryAUROC(thresholds=101)
    for part in range(2):
        ours.update(probabilities[part::2], labels[part::2])
        theirs.update(probabilities[part::2], labels[part::2])
    assert torch.equal(ours.confmat, theirs.confmat)
    assert float(ours.compute()) == float(theirs.compute())
    # The binned precision-recall AUC: torchmetrics' binned average precision of the same table.
    binned = build_eval_metrics("val/", "binned", 101)
    for part in range(2):
        binned.update(probabilities[part::2], labels[part::2])
    assert float(binned.compute()["val/pr_auc"]) == float(BinaryAveragePrecision(thresholds=101)(probabilities, labels))


@pytest.mark.parametrize(
    ("num_thresholds", "measured_error", "max_error"),
    [(100, 1.222e-05, 5.7344e-03), (1_000, 3.10e-06, 5.6790e-04), (10_000, 5.4e-07, 5.7085e-05)],
)
def test_binned_auc_stays_within_its_stated_error_of_the_exact_auc(num_thresholds, measured_error, max_error):
    probabilities, labels = _predictions(20_000)
    exact = BinaryAUROC()(probabilities, labels)
    binned = build_eval_metrics("val/", "binned", num_thresholds)(probabilities, labels)

    error = abs(float(binned["val/auc"]) - float(exact))
    # Measured here; the bound below is the promise. The predictions come from torch's vectorised randn and
    # sigmoid, which round by CPU capability: ATen's default kernels (a CPU without AVX2) moved 6,006 of them by
    # up to 5.4e-7, the error by 6e-8 (one float32 step of an AUC near 0.71) and max_error by 1.2e-4 relative;
    # AVX2's equal AVX-512's. The tolerances are 4 steps and 8 times that.
    assert error == pytest.approx(measured_error, abs=2.5e-7)
    assert float(binned["val/auc_max_error"]) == pytest.approx(max_error, rel=1e-3)
    recount = _max_error(probabilities.numpy(), labels.numpy(), num_thresholds)
    assert float(binned["val/auc_max_error"]) == pytest.approx(recount, rel=1e-5)
    assert error <= float(binned["val/auc_max_error"]) <= 0.6 / num_thresholds  # "about 0.5 / thresholds"
    # The table is thresholds x 2 x 2 counts whatever the number of predictions.
    assert build_eval_metrics("val/", "binned", num_thresholds)["auc"].confmat.shape == (num_thresholds, 2, 2)


def test_calibration_is_mean_prediction_over_click_rate():
    metric = Calibration()
    metric.update(torch.tensor([0.1, 0.2, 0.3]), torch.tensor([0, 1, 0]))
    metric.update(torch.tensor([0.4]), torch.tensor([1]))
    assert float(metric.compute()) == pytest.approx((0.1 + 0.2 + 0.3 + 0.4) / 4 / (2 / 4))


def test_an_unknown_mode_names_the_setting():
    with pytest.raises(ValueError, match="model.eval_metrics = 'approx': use exact or binned"):
        build_eval_metrics("val/", "approx")


def _evaluated_predictions(cli) -> dict:
    """Every rank's validation predictions as the eval loop made them (same batches, same order),
    gathered, with the number of padding rows the ranks' batches held, then the same set evaluated
    again with the binned AUC through trainer.validate."""
    module, trainer = cli.trainer.lightning_module, cli.trainer
    logged = {k: float(v) for k, v in trainer.callback_metrics.items()}
    module.eval()
    mine, num_padding_rows = [], 0
    with torch.no_grad():
        for batch in cli.datamodule.val_dataloader():
            valid = batch.valid_rows
            mine.append((batch.row_ids[valid], torch.sigmoid(module(batch))[valid], batch.labels[valid]))
            num_padding_rows += int((batch.row_ids == PADDING_ROW_ID).sum())
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, ([tuple(t.numpy() for t in part) for part in mine], num_padding_rows))
    row_ids, probabilities, labels = (np.concatenate([p[i] for rank, _ in gathered for p in rank]) for i in range(3))
    module.val_metrics = build_eval_metrics("val/", "binned", 100)
    trainer.validate(module, datamodule=cli.datamodule, verbose=False)
    binned = {k: float(v) for k, v in trainer.callback_metrics.items()}
    return {"logged": logged, "binned": binned, "row_ids": row_ids, "probabilities": probabilities, "labels": labels,
            "padding_rows_per_rank": [padding for _, padding in gathered]}  # fmt: skip


def _one_process_metrics(probabilities: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """AUC and log loss of the rows on one process, through the same metric classes without any sync."""
    p, y = torch.from_numpy(probabilities), torch.from_numpy(labels).long()
    log_loss = LogLoss()
    log_loss.update(p, y)
    return {"val/auc": float(BinaryAUROC()(p, y)), "val/logloss": float(log_loss.compute())}


# 257 rows over 2 ranks in batches of 64: steps of 128, 128 and 1 row, so in the third step rank 1 has
# no real row and gets one padding row (a copy of row 0, row id -1) to keep the ranks' steps equal.
VAL_ROWS, BATCH_SIZE_PER_RANK = 257, 64


def test_distributed_metrics_leave_the_padding_out_and_equal_one_process_metrics(tmp_path):
    val = tmp_path / "val.tsv"
    write_synthetic_criteo(val, num_rows=VAL_ROWS, seed=12)
    args = [
        "validate", "--config", "configs/demo.yaml", *DEMO_BEFORE_QUALITY_SETTINGS, "--data.train", "null", "--data.val", str(val),
        "--data.test", "null", "--data.predict", "null", "--data.batch_size", str(BATCH_SIZE_PER_RANK),
        "--data.num_embeddings_per_feature", "500", "--model.embedding_dim", "8",
        "--model.dense_arch_layer_sizes", "[16, 8]", "--model.over_arch_layer_sizes", "[16, 1]",
        "--trainer.logger", "false", "--trainer.callbacks", "[]", "--trainer.enable_progress_bar", "false",
        "--trainer.default_root_dir", str(tmp_path),
    ]  # fmt: skip
    result = run_on_ranks(2, args, tmp_path, _evaluated_predictions)[0]

    assert result["padding_rows_per_rank"] == [0, 1]  # the case under test: rank 1's last batch is padding
    order = np.argsort(result["row_ids"])  # gathered rank after rank
    assert result["row_ids"][order].tolist() == list(range(VAL_ROWS))  # every real row once, padding left out
    p, y = result["probabilities"][order], result["labels"][order]
    logged = result["logged"]
    # Over 2 ranks exactly what one process computes from the real rows alone ...
    real_rows_only = _one_process_metrics(p, y)
    assert {name: logged[name] for name in real_rows_only} == real_rows_only
    # ... which the padding row (row 0 once more) would change: counting it could not pass.
    with_padding = _one_process_metrics(np.r_[p, p[:1]], np.r_[y, y[:1]])
    assert all(with_padding[name] != real_rows_only[name] for name in real_rows_only), with_padding
    assert logged["val/auc"] != pytest.approx(0.5, abs=1e-3)  # predictions that order the rows
    p64 = p.astype(np.float64)
    assert logged["val/auc"] == pytest.approx(rank_auc(p64, y), abs=1e-7)  # by hand: the rank-sum statistic
    assert logged["val/calibration"] == pytest.approx(p64.mean() / y.mean(), rel=1e-6)
    # The binned AUC of the same predictions: its stated error, summed over ranks exactly.
    binned = result["binned"]
    assert binned["val/auc_max_error"] == pytest.approx(_max_error(p, y, 100), rel=1e-5)
    assert abs(binned["val/auc"] - logged["val/auc"]) <= binned["val/auc_max_error"]
    assert binned["val/logloss"] == logged["val/logloss"]


def test_the_mode_is_a_yaml_setting(capsys):
    from app.cli import cli_main

    try:
        cli_main(["fit", "--config", "configs/demo.yaml", "--model.eval_metrics", "binned",
                  "--model.auc_num_thresholds", "1000", "--print_config"])  # fmt: skip
    except SystemExit as exit_info:
        assert exit_info.code in (0, None)
    printed = capsys.readouterr().out
    assert "eval_metrics: binned" in printed and "auc_num_thresholds: 1000" in printed


def test_exact_auc_is_refused_before_training_when_the_host_cannot_hold_it():
    # 89M rows (Criteo Terabyte's day 23 half) on a host of 8 ranks.
    with pytest.raises(ValueError) as refused:
        check_exact_auc_memory(89_000_000, "val", 8, available_host_bytes=32 * 2**30)
    assert str(refused.value) == (
        "model.eval_metrics = exact: every rank gathers and sorts the 89,000,000 rows of data.val in host memory "
        "at each evaluation, about 6.6 GiB per rank, 53.0 GiB for the 8 ranks of this machine, more than the "
        "32.0 GiB available; model.eval_metrics: binned takes constant memory and logs its error bound (auc_max_error)"
    )
    warning = check_exact_auc_memory(89_000_000, "val", 8, available_host_bytes=512 * 2**30)
    assert warning.startswith("model.eval_metrics = exact: every rank gathers") and "binned" in warning
    assert check_exact_auc_memory(89_000_000, "val", 8, available_host_bytes=None) == warning  # not known: no refusal
    assert check_exact_auc_memory(1_000_000, "test", 2, available_host_bytes=2**30) is None  # 76 MiB per rank: quiet


def test_only_the_exact_auc_keeps_its_states_in_host_memory():
    metrics = build_eval_metrics("val/", "exact")
    probabilities, labels = _predictions(1_000)
    metrics.update(probabilities, labels)
    metrics.update(probabilities, labels)
    # On a GPU torchmetrics moves list states to the host after every update (compute_on_cpu).
    assert metrics["auc"].compute_on_cpu and {t.device.type for t in metrics["auc"].preds} == {"cpu"}
    on_host = ["auc", "pr_auc"]
    assert not any(m.compute_on_cpu for name, m in metrics.items(keep_base=True) if name not in on_host)
    # The precision-recall AUC reads the AUC's predictions: one copy of them, not two.
    auc, pr_auc = (metrics.__getitem__(name, copy_state=False) for name in on_host)
    assert [t.data_ptr() for t in pr_auc.preds] == [t.data_ptr() for t in auc.preds]
    # A sync_exact_auc_through group goes to the exact AUCs only: the running sums sync as before.
    marker = object()
    sync_exact_auc_through(metrics, marker)
    assert [name for name, m in metrics.items(keep_base=True) if m.process_group is marker] == on_host
