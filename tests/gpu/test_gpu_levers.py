"""The speed levers of issue 17 on GPUs (docs/performance.md): compiled dense layers (also replayed as
CUDA graphs), fp16 tables, tables in host memory behind an HBM cache (UVM caching), compressed
all-to-all (two GPUs), each trained through ``python -m app fit`` against the reference run.

Tolerances: compile changes the order of float32 sums in the dense layers (~1e-6 relative per step,
carried through 24 updates: 1e-4 on the probabilities, as for another sharding); fp16 tables keep 11
significant bits of each weight (5e-4 relative) and round updates stochastically, and bf16 communication
keeps 8 (4e-3): their probabilities are compared to within a few hundredths, as bf16-mixed's are. UVM
caching changes where a row lives, not its value or its update: 1e-4, as for compile.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from torchrec.datasets.criteo import DEFAULT_CAT_NAMES

from tests.gpu.gpu_env import needs_gpus
from tests.gpu.gpu_runs import losses, max_abs_difference, plan_report, with_settings

pytestmark = pytest.mark.gpu


def _trained(run: dict) -> None:
    assert run["device"].startswith("cuda") and all(math.isfinite(loss) for loss in losses(run))
    assert np.abs(run["probabilities"] - 0.5).max() > 0.05  # training moved the model


@pytest.mark.parametrize(
    ("mode", "pipeline"), [("default", "sparse_dist"), ("reduce-overhead", "sparse_dist"), ("reduce-overhead", "none")]
)
def test_compiled_dense_layers_train_to_the_eager_runs_probabilities(
    app_runs, reference_args, reference, mode, pipeline, record_property
):
    """``model.compile``, and its ``reduce-overhead`` mode (CUDA graphs) through TorchRec's pipeline and
    Lightning's plain loop; the reference validates twice an epoch, so evaluation (no backward, another
    batch size) runs compiled and replays too."""
    args = with_settings(reference_args, model__compile="true", model__compile_mode=mode, model__pipeline=pipeline)
    (run,) = app_runs(f"compiled_{mode}_{pipeline}", 1, args)
    _trained(run)
    assert [s[3] for s in run["steps"]] == [s[3] for s in reference["steps"]]
    difference = max_abs_difference(run["probabilities"], reference["probabilities"])
    record_property("max_abs_probability_difference_vs_eager", difference)
    record_property("wall_s_compiled_vs_eager", [round(run["wall_s"], 1), round(reference["wall_s"], 1)])
    np.testing.assert_allclose(run["probabilities"], reference["probabilities"], rtol=0, atol=1e-4)


def test_fp16_tables_train_and_the_plan_says_fp16(app_runs, reference_args, reference, record_property):
    (run,) = app_runs("fp16_tables", 1, with_settings(reference_args, model__embedding_precision="fp16"))
    _trained(run)
    tables = plan_report(run)["tables"]
    assert {table["precision"] for table in tables} == {"fp16"}
    difference = max_abs_difference(run["probabilities"], reference["probabilities"])
    record_property("max_abs_probability_difference_vs_fp32_tables", difference)
    assert difference < 0.05


def test_uvm_caching_tables_train_to_the_hbm_tables_probabilities(app_runs, reference_args, reference, record_property):
    """Every table in host memory behind an HBM cache of a fifth of its rows (``fused_uvm_caching``,
    ``cache_load_factor`` 0.2): most lookups of a step miss the cache, so rows are fetched, updated in
    the cache and written back on eviction, through validation too. The plan report says so per table."""
    constraints = {
        f"t_{name}": {"compute_kernels": ["fused_uvm_caching"], "cache_load_factor": 0.2} for name in DEFAULT_CAT_NAMES
    }
    args = with_settings(reference_args, trainer__strategy__table_constraints=json.dumps(constraints))
    (run,) = app_runs("uvm_caching", 1, args)
    _trained(run)
    tables = plan_report(run)["tables"]
    assert {(t["compute_kernel"], t["cache_load_factor"], t["in_host_memory"]) for t in tables} == {("fused_uvm_caching", 0.2, True)}
    assert [s[3] for s in run["steps"]] == [s[3] for s in reference["steps"]]
    difference = max_abs_difference(run["probabilities"], reference["probabilities"])
    record_property("max_abs_probability_difference_vs_hbm_tables", difference)
    record_property("wall_s_uvm_caching_vs_hbm", [round(run["wall_s"], 1), round(reference["wall_s"], 1)])
    np.testing.assert_allclose(run["probabilities"], reference["probabilities"], rtol=0, atol=1e-4)


@needs_gpus(2)
def test_bf16_communication_trains_close_to_uncompressed_on_two_gpus(app_runs, sample, reference, record_property):
    from tests.gpu.gpu_runs import GPU
    from tests.distributed.test_sharding import fit_args

    args = fit_args(sample, "{root}", "table_wise", 64) + GPU + [
        "--model.pipeline", "sparse_dist", "--trainer.callbacks+=tests.training_probe.TrainingProbe",
        "--trainer.strategy.init_args.qcomms", "{forward_precision: bf16, backward_precision: bf16}",
    ]  # fmt: skip
    ranks = app_runs("qcomms_bf16_2", 2, args)
    for rank in ranks:
        _trained(rank)
        assert rank["backend"] == "nccl"
    difference = max_abs_difference(ranks[0]["probabilities"], reference["probabilities"])
    record_property("max_abs_probability_difference_vs_one_gpu_fp32", difference)
    assert difference < 0.05
