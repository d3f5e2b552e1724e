"""Stop mid-epoch, resume from the sharded checkpoint: the result is the uninterrupted run's, exactly."""

from __future__ import annotations

import numpy as np

from multiprocess import run_on_ranks
from test_sharding import fit_args, shards_and_predictions


def test_resuming_mid_epoch_reproduces_the_uninterrupted_run(sample, tmp_path):
    checkpoints = tmp_path / "checkpoints"
    args = fit_args(sample, tmp_path, "table_wise", 64)
    args[args.index("--trainer.enable_checkpointing") + 1] = "true"
    every_7_steps = [
        "--checkpoint.filename", "{step}",
        "--checkpoint.every_n_train_steps", "7",
        "--checkpoint.save_top_k", "-1",
        "--checkpoint.monitor", "null",
        "--checkpoint.save_last", "false",
    ]  # fmt: skip
    uninterrupted = run_on_ranks(2, args + every_7_steps, tmp_path, shards_and_predictions)
    # 12 steps per epoch: step 7 is in the middle of the first epoch, step 14 in the second.
    assert sorted(p.name for p in checkpoints.glob("*.ckpt")) == ["step=14.ckpt", "step=21.ckpt", "step=7.ckpt"]

    for step in (7, 14):
        resumed = run_on_ranks(
            2, args + ["--ckpt_path", str(checkpoints / f"step={step}.ckpt")], tmp_path, shards_and_predictions
        )
        assert resumed[0]["global_step"] == uninterrupted[0]["global_step"] == 24
        np.testing.assert_allclose(resumed[0]["probabilities"], uninterrupted[0]["probabilities"], rtol=0, atol=1e-6)
