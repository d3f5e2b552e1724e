"""TorchRec's other training pipelines on one GPU, through ``model.pipeline``: the lite pipeline (one batch
in flight) and the fused one (each batch's lookup on its own stream, overlapping the previous optimizer step)
train the reference fit's batches to its losses, with validations in the middle (the pipeline paused and
resumed around each), to the same tolerance as the plain loop against ``sparse_dist``."""

from __future__ import annotations

import numpy as np
import pytest

from tests.gpu.gpu_runs import losses, max_abs_difference, with_settings

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("pipeline", ["sparse_dist_lite", "fused_sparse_dist"])
def test_torchrecs_other_pipelines_train_to_the_sparse_dist_losses(pipeline, app_runs, reference_args, reference, record_property):
    (run,) = app_runs(f"pipeline_{pipeline}", 1, with_settings(reference_args, model__pipeline=pipeline))
    assert run["global_step"] == reference["global_step"] and run["device"].startswith("cuda")
    assert [s[3] for s in run["steps"]] == [s[3] for s in reference["steps"]]  # the same batches, in order
    record_property("max_abs_loss_difference_vs_sparse_dist", max_abs_difference(losses(run), losses(reference)))
    np.testing.assert_allclose(losses(run), losses(reference), rtol=0, atol=1e-6)
    for run_pass, reference_pass in zip(run["validations"], reference["validations"], strict=True):
        assert run_pass[0] == reference_pass[0] and run_pass[1] == reference_pass[1]  # no training batch leaked in
        assert run_pass[2] == pytest.approx(reference_pass[2], abs=1e-6)
    np.testing.assert_allclose(run["probabilities"], reference["probabilities"], rtol=0, atol=1e-6)
