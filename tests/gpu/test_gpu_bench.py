"""``make bench`` on GPUs: the app against the plain TorchRec loop on every GPU of the machine (up to 8),
with the HBM figures and the embedding kernels' share of the HBM bandwidth in the report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from torchrec.datasets.criteo import DEFAULT_CAT_NAMES

from tests.gpu.gpu_env import gpu_count

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
BENCH_TIMEOUT_S = 1500  # 20 runs, four of them compiling
# `make bench` is `python -m app.bench $(BENCH_ARGS)`; called directly so that make does not redo the
# environment. The torchrec_reference preset (26 tables x 100,000 x 64, Adagrad, batch 512 per
# process on CPU) moved to the GPUs with a batch a GPU is used with: 4,096 per GPU. Two repeats of the
# app, its plain-loop variant and the raw loop; 5 profiled steps give the phase table and the share.
GPU_BENCH_ARGS = [
    "--preset", "torchrec_reference", "--run.accelerator", "gpu", "--data.batch_size_per_rank", "4096",
    "--run.repeats", "2", "--run.warmup_steps", "20", "--run.measured_steps", "100", "--run.profile_steps", "5",
    # Every speed lever of docs/performance.md as a variant (the preset's CPU variants, and the GPU-only ones):
    # the dense layers compiled and replayed as CUDA graphs, and every table in host memory behind an HBM
    # cache of a fifth of its rows (FBGEMM's UVM caching kernel, what the planner picks for tables that spill).
    "--app_variants", json.dumps({
        "app_plain": {"pipeline": "none"}, "app_compiled": {"compile": True}, "app_fp16_tables": {"embedding_precision": "fp16"},
        "app_qcomms_bf16": {"strategy": {"qcomms": {"forward_precision": "bf16", "backward_precision": "bf16"}}},
        "app_cuda_graphs": {"compile": True, "compile_mode": "reduce-overhead"},
        # TorchRec's other pipelines: one batch in flight; the lookup overlapping the previous optimizer step.
        "app_sparse_dist_lite": {"pipeline": "sparse_dist_lite"}, "app_fused_sparse_dist": {"pipeline": "fused_sparse_dist"},
        "app_uvm_caching": {"strategy": {"table_constraints": {
            f"t_{name}": {"compute_kernels": ["fused_uvm_caching"], "cache_load_factor": 0.2} for name in DEFAULT_CAT_NAMES
        }}},
    }),
]  # fmt: skip
RUNS_PER_REPEAT = 10  # app, raw and the eight variants
_LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", "GLOBAL_RANK", "RANK")


def test_the_bench_on_gpus_app_against_raw(tmp_path, record_property):
    world_size = min(gpu_count(), 8)
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARIABLES} | {"PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "app.bench", *GPU_BENCH_ARGS, "--run.world_size", str(world_size), "--run.output_dir", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=BENCH_TIMEOUT_S, cwd=REPO, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    runs, summary = lines[:-1], lines[-1]
    assert summary["summary"] is True and len(runs) == 2 * RUNS_PER_REPEAT
    assert summary["same_plan"] is True and summary["same_batches"] is True
    assert summary["variants_with_another_plan"] == ["app_uvm_caching"]
    assert all("fused_uvm_caching" in line["plan"] for line in runs if line["run"] == "app_uvm_caching")
    for line in runs:
        assert line["device"].startswith(f"{world_size} x ") and line["world_size"] == world_size
        for rank in line["peak_memory_per_rank"]:
            # The tables live in HBM: the peak over the measured steps is compared with what a rank must hold.
            assert rank["basis"] == "hbm" and rank["peak_hbm_allocated_bytes"] >= rank["hbm_allocated_at_measure_start_bytes"] > 0
        phases = line["phases_ms_per_step_rank0"]
        assert set(phases) == {"host_ms", "device_ms", "wall_ms"}
        # The kernels' share of the measured steps and the host time around them, from the profiled steps.
        assert line["gpu_busy_reason"] is None and line["gpu_busy_fraction"] > 0 and line["host_ms_per_step_outside_kernels"] >= 0
        share = line["embedding_hbm_bandwidth_rank0"]
        assert share["share"] is not None and share["share"] > 0 and share["lookup_device_ms_per_step"] > 0
    record_property("world_size", world_size)
    record_property("summary", {k: v for k, v in summary.items() if not k.endswith("_per_repeat")})
    record_property("runs", [
        {
            "run": line["run"], "repeat": line["repeat"], "samples_per_s_median": line["samples_per_s_median"],
            "step_ms_p50": line["step_ms_p50"], "gpu_busy_fraction": line["gpu_busy_fraction"],
            "host_ms_per_step_outside_kernels": line["host_ms_per_step_outside_kernels"],
            "peak_hbm_allocated_bytes": [r["peak_hbm_allocated_bytes"] for r in line["peak_memory_per_rank"]],
            "growth_over_expected": [r["growth_over_expected"] for r in line["peak_memory_per_rank"]],
            "peak_rss_bytes": [r["peak_rss_bytes"] for r in line["peak_memory_per_rank"]],
            "embedding_hbm_bandwidth_rank0": line["embedding_hbm_bandwidth_rank0"],
            "phases_ms_per_step_rank0": line["phases_ms_per_step_rank0"],
        }
        for line in runs
    ])  # fmt: skip
