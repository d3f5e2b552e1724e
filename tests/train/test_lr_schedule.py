"""The MLPerf DLRMv2 learning-rate schedule reaches the dense and the fused embedding optimizer, step by step."""

from __future__ import annotations

import csv

import numpy as np
import pytest
import torch

from app.train.lr_schedule import LRSchedule
from tests.multiprocess import run_on_ranks
from tests.distributed.test_sharding import fit_args, shards_and_predictions

SCHEDULE = {"lr_warmup_steps": 3, "lr_decay_start": 5, "lr_decay_steps": 4, "lr_decay_power": 2.0, "lr_decay_end_factor": 0.1}
# Factor of the base rate for the step after k completed steps, k = 0 .. 10, worked out by hand.
EXPECTED_FACTORS = [1 / 3, 2 / 3, 1.0, 1.0, 1.0, 1.0, (3 / 4) ** 2, (2 / 4) ** 2, 0.1, 0.1, 0.1]
DENSE_LR, SPARSE_LR = 0.1, 0.2
NUM_STEPS = 10


def float32(value: float) -> float:
    return torch.tensor(value, dtype=torch.float32).item()


def test_schedule_factors():
    schedule = LRSchedule(3, 5, 4, 2.0, 0.1)
    assert [schedule.factor(k) for k in range(11)] == EXPECTED_FACTORS
    assert LRSchedule().is_constant and LRSchedule().factor(123) == 1.0
    with pytest.raises(ValueError, match="model.lr_decay_start = 2 is inside the warm-up"):
        LRSchedule(warmup_steps=3, decay_start=2, decay_steps=4)


def fbgemm_kernels(optimizer) -> list:
    """The FBGEMM embedding modules under TorchRec's (nested) combined fused optimizer."""
    if hasattr(optimizer, "optimizers"):
        return [kernel for _, child in optimizer.optimizers for kernel in fbgemm_kernels(child)]
    return [optimizer._emb_module]


def learning_rates(cli) -> dict:
    """The rates held by the real optimizer objects after training."""
    parts = dict(cli.trainer.optimizers[0].optimizers)
    embedding_kernels = fbgemm_kernels(parts["sparse"])
    return {
        "global_step": cli.trainer.global_step,
        "dense_group_lrs": [g["lr"] for g in parts["dense"].param_groups],
        "sparse_group_lrs": [g["lr"] for g in parts["sparse"].param_groups],
        "kernel_lrs": [kernel.get_learning_rate() for kernel in embedding_kernels],
        "probabilities": shards_and_predictions(cli)["probabilities"],  # of the model these rates trained
    }


def schedule_args(sample, root, pipeline: str) -> list[str]:
    """NUM_STEPS steps of the schedule above through ``pipeline``, the rates logged at every step and
    a checkpoint every RESUME_STEP steps into ``root/checkpoints/step=N.ckpt``."""
    args = fit_args(sample, root, "table_wise", 64)
    args[args.index("--model.dense_learning_rate") + 1] = str(DENSE_LR)
    args[args.index("--trainer.logger") + 1] = "lightning.pytorch.loggers.CSVLogger"
    args[args.index("--trainer.enable_checkpointing") + 1] = "true"
    args += ["--trainer.logger.init_args.save_dir", str(root), "--trainer.logger.init_args.name", "logs"]
    args += ["--trainer.log_every_n_steps", "1", "--trainer.max_steps", str(NUM_STEPS), "--trainer.limit_val_batches", "0"]
    args += ["--model.sparse_learning_rate", str(SPARSE_LR), "--model.pipeline", pipeline]
    args += ["--checkpoint.filename", "{step}", "--checkpoint.every_n_train_steps", str(RESUME_STEP),
             "--checkpoint.save_top_k", "-1", "--checkpoint.monitor", "null", "--checkpoint.save_last", "false"]  # fmt: skip
    return args + [item for key, value in SCHEDULE.items() for item in (f"--model.{key}", str(value))]


# Mid-warm-up: a resumed run that restarted the schedule would train its next step at 1/3 of the rate.
RESUME_STEP = 2


def logged_rates(root) -> dict[int, tuple[str, str]]:
    """train/lr and train/lr_embedding per step, as the CSV holds them (the step column counts from 0)."""
    (metrics_file,) = root.glob("logs/version_*/metrics.csv")
    with metrics_file.open() as f:
        rows = [row for row in csv.DictReader(f) if row.get("train/lr")]
    return {int(row["step"]): (row["train/lr"], row["train/lr_embedding"]) for row in rows}


@pytest.fixture(scope="module")
def pipelined(sample, tmp_path_factory) -> dict:
    """The schedule through the sparse_dist pipeline (manual optimization: the module steps it)."""
    root = tmp_path_factory.mktemp("pipelined")
    return {"root": root, "ranks": run_on_ranks(2, schedule_args(sample, root, "sparse_dist"), root, learning_rates)}


def assert_rates_of_the_schedule(ranks: list[dict], logged: dict[int, tuple[str, str]], steps: range) -> None:
    for rank in ranks:
        assert rank["global_step"] == NUM_STEPS
        # The scheduler has advanced past the last step: the groups hold the next step's rate ...
        assert set(rank["dense_group_lrs"]) == {DENSE_LR * EXPECTED_FACTORS[NUM_STEPS]}
        # The fused optimizer's base rate is the one FBGEMM holds, in float32.
        sparse_base = float32(SPARSE_LR)
        assert set(rank["sparse_group_lrs"]) == {sparse_base * EXPECTED_FACTORS[NUM_STEPS]}
        # ... while the FBGEMM kernels still hold the rate the last step's backward updated the tables with.
        assert rank["kernel_lrs"] and set(rank["kernel_lrs"]) == {float32(sparse_base * EXPECTED_FACTORS[NUM_STEPS - 1])}
    # Logged values pass through float32 tensors.
    assert {step: (float(dense), float(sparse)) for step, (dense, sparse) in logged.items()} == {
        k: (pytest.approx(DENSE_LR * EXPECTED_FACTORS[k], rel=1e-6), pytest.approx(SPARSE_LR * EXPECTED_FACTORS[k], rel=1e-6))
        for k in steps
    }


def test_schedule_drives_both_optimizers_and_is_logged(pipelined):
    assert_rates_of_the_schedule(pipelined["ranks"], logged_rates(pipelined["root"]), range(NUM_STEPS))


def test_a_resumed_schedule_under_the_plain_loop_continues_the_uninterrupted_rates_exactly(pipelined, sample, tmp_path):
    # Resumed mid-warm-up from the pipelined run's checkpoint, under Lightning's plain loop (automatic
    # optimization: Lightning steps the scheduler), which must restore the scheduler's step count.
    checkpoint = pipelined["root"] / "checkpoints" / f"step={RESUME_STEP}.ckpt"
    args = schedule_args(sample, tmp_path, "none") + ["--ckpt_path", str(checkpoint)]
    ranks = run_on_ranks(2, args, tmp_path, learning_rates)
    resumed = logged_rates(tmp_path)
    assert_rates_of_the_schedule(ranks, resumed, range(RESUME_STEP, NUM_STEPS))
    # Exactly the uninterrupted run's rates, step by step and in the optimizers at the end.
    uninterrupted = logged_rates(pipelined["root"])
    assert resumed == {step: uninterrupted[step] for step in range(RESUME_STEP, NUM_STEPS)}
    for rank, uninterrupted_rank in zip(ranks, pipelined["ranks"]):
        probabilities, expected = rank.pop("probabilities"), dict(uninterrupted_rank).pop("probabilities")
        assert rank == {k: v for k, v in uninterrupted_rank.items() if k != "probabilities"}
        # The same model: every resumed step, the first included, updated dense layers and tables at its rate.
        np.testing.assert_array_equal(probabilities, expected)
