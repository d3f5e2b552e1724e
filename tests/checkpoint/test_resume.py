"""Stop mid-epoch, resume from the sharded checkpoint: the result is the uninterrupted run's, exactly."""

from __future__ import annotations

import numpy as np

from app.train.fused_step_count import training_kernels
from tests.multiprocess import run_on_ranks
from tests.distributed.test_sharding import fit_args, shards_and_predictions


def checkpointed_every_7_steps(sample, tmp_path, batch_size_per_rank: int) -> list[str]:
    """fit_args with a checkpoint named by its step every 7 steps, all kept, none as last."""
    args = fit_args(sample, tmp_path, "table_wise", batch_size_per_rank)
    args[args.index("--trainer.enable_checkpointing") + 1] = "true"
    return args + [
        "--checkpoint.filename", "{step}",
        "--checkpoint.every_n_train_steps", "7",
        "--checkpoint.save_top_k", "-1",
        "--checkpoint.monitor", "null",
        "--checkpoint.save_last", "false",
    ]  # fmt: skip


def test_resuming_mid_epoch_reproduces_the_uninterrupted_run(sample, tmp_path):
    checkpoints = tmp_path / "checkpoints"
    args = checkpointed_every_7_steps(sample, tmp_path, 64)
    uninterrupted = run_on_ranks(2, args, tmp_path, shards_and_predictions)
    # 12 steps per epoch: step 7 is in the middle of the first epoch, step 14 in the second.
    assert sorted(p.name for p in checkpoints.glob("*.ckpt")) == ["step=14.ckpt", "step=21.ckpt", "step=7.ckpt"]

    for step in (7, 14):
        resumed = run_on_ranks(
            2, args + ["--ckpt_path", str(checkpoints / f"step={step}.ckpt")], tmp_path, shards_and_predictions
        )
        assert resumed[0]["global_step"] == uninterrupted[0]["global_step"] == 24
        np.testing.assert_allclose(resumed[0]["probabilities"], uninterrupted[0]["probabilities"], rtol=0, atol=1e-6)


def test_validating_mid_epoch_leaves_the_embedding_kernels_step_count_at_the_training_steps(sample, tmp_path):
    # FBGEMM's Adam (a GPU kernel) takes its bias correction from a step count in each kernel, which
    # every forward advances, evaluation included; a resume restores it as the number of training
    # steps. So a validation must leave it alone, or a run resumed after one trains on with another
    # correction than the run that wrote the checkpoint (tests/gpu/test_gpu_checkpoints.py trains
    # Adam). FBGEMM's CPU row-wise Adagrad keeps the same count, which is asserted here.
    checkpoints = tmp_path / "checkpoints"
    args = checkpointed_every_7_steps(sample, tmp_path, 128)  # one process: 12 steps an epoch, 24 in all
    args += ["--trainer.val_check_interval", "0.5"]  # validations after steps 6, 12, 18 and 24
    (uninterrupted,) = run_on_ranks(1, args, tmp_path, kernel_step_counts)
    (resumed,) = run_on_ranks(1, args + ["--ckpt_path", str(checkpoints / "step=7.ckpt")], tmp_path, kernel_step_counts)
    for run in (uninterrupted, resumed):
        assert run["global_step"] == 24 and run["validation_batches"] > 0
        assert run["counts"] and run["counts"] == run["compute_counts"] == [24] * len(run["counts"])


def kernel_step_counts(cli) -> dict:
    """The step counts of rank 0's FBGEMM kernels after fit: the one checkpointed and the one computed with."""
    kernels = training_kernels(cli.trainer.lightning_module)
    return {
        "global_step": cli.trainer.global_step,
        "validation_batches": sum(cli.trainer.num_val_batches),
        "counts": [int(k.iter.item()) for k in kernels],
        "compute_counts": [int(k.iter_cpu.item()) for k in kernels],
    }
