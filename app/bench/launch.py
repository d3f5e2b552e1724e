"""Starts one benchmark run: ``world_size`` fresh processes on this machine, set up the way torchrun sets
up its workers (MASTER_ADDR/PORT, RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE), for either side.

Both sides start the same way, so neither gets a start-up or thread-setting advantage. A rank that
fails ends the others (torch.multiprocessing terminates them) and its error reaches the caller.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from torchrec.datasets.criteo import DEFAULT_CAT_NAMES
from torchrec.optim.optimizers import in_backward_optimizer_filter

from app.bench.measure import (
    StepClock, autograd_working_set_bytes, embedding_bytes_per_step, expected_memory_bytes, hbm_bandwidth_share, peak_memory,
)  # fmt: skip
from app.bench.phases import EMBEDDING, StepProfiler
from app.bench.settings import BenchSpec
from app.bench.trained_batches import TrainedBatches
from app.distributed.sharding import format_plan
from app.distributed.topology import resolve_topology
from app.model.dlrm import table_name
from app.notices import silence_library_notices

TABLE_PREFIX = "model.sparse_arch."  # where both sides' models keep their tables


def run_on_ranks(spec: BenchSpec, side: str, model_overrides: dict[str, Any], label: str) -> list[dict[str, Any]]:
    """Runs one side on ``spec.run.world_size`` processes; returns each rank's report. ``label`` names
    the run's profiler trace."""
    with tempfile.TemporaryDirectory(prefix="bench_") as out_dir:
        mp.start_processes(
            _worker,
            args=(spec, side, model_overrides, label, _free_port(), out_dir),
            nprocs=spec.run.world_size,
            start_method="spawn",
        )
        return [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(spec.run.world_size)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(
    rank: int, spec: BenchSpec, side: str, model_overrides: dict[str, Any], label: str, port: int, out_dir: str
) -> None:
    world_size = str(spec.run.world_size)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0",
        WORLD_SIZE=world_size, LOCAL_WORLD_SIZE=world_size,
    )  # fmt: skip
    silence_library_notices()  # as `python -m app` does, on both sides
    atexit.register(gc.freeze)  # and, as it does (app/__main__.py), no last garbage collection over every object at exit
    # The bench's standard output is its JSON lines: what a rank prints (a variant's progress bar, which
    # Lightning draws on stdout) goes to standard error.
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    device = torch.device("cpu") if spec.device_type == "cpu" else torch.device("cuda", rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(spec.run.seed)
    run = spec.run
    profiler = None
    if run.profile_steps and rank == 0:
        profiler = StepProfiler(Path(run.output_dir) / f"{spec.name}_{label}_rank0.trace.json", device)
    clock = StepClock(run.warmup_steps, run.measured_steps, device, profiler, run.profile_steps)
    trained = TrainedBatches()
    # Imported here: each side pays only for its own libraries.
    if side in ("raw", "raw_base"):
        from app.bench.raw_side import run_raw

        result = run_raw(spec, clock, trained, rank, device, overlap=side == "raw")
    else:
        from app.bench.app_side import run_app

        result = run_app(spec, model_overrides, clock, trained, rank, device)
    report = _rank_report(spec, rank, device, clock, result)
    report.update(rows_per_step=trained.rows_per_step, batches_checksum=trained.checksum())
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))


def _rank_report(spec: BenchSpec, rank: int, device: torch.device, clock: StepClock, result: dict[str, Any]) -> dict:
    model = spec.model_args()
    rows = model["num_embeddings_per_feature"]
    table_shapes = {table_name(feature): (r, model["embedding_dim"]) for feature, r in zip(DEFAULT_CAT_NAMES, rows)}
    dense_parameters = sum(
        p.numel() for name, p in in_backward_optimizer_filter(result["module"].named_parameters())
        if not name.startswith(TABLE_PREFIX)
    )  # fmt: skip
    inputs = spec.inputs
    step_bytes = autograd_working_set_bytes(model, inputs.batch_size_per_rank, inputs.pooling_factors())
    # Mapped data files are host memory: they count against RSS on CPU, not against HBM on GPUs.
    mapped_bytes = inputs.mapped_data_bytes(spec.total_steps) if device.type == "cpu" else 0
    expected = expected_memory_bytes(
        result["plan"], rank, table_shapes, model["sparse_optimizer"], dense_parameters, model["dense_optimizer"],
        inputs.batch_bytes(), step_bytes, mapped_bytes, inputs.batch_size_per_rank * spec.run.world_size,
    )  # fmt: skip
    return {
        "step_times_s": clock.step_times_s(),
        "phases_ms_per_step": clock.phases_ms,
        "kernel_busy_ms_per_step": clock.kernel_busy_ms_per_step,
        "memory": {**peak_memory(device, clock.rss_at_setup_bytes, clock.hbm), "expected_bytes": expected},
        "threads": torch.get_num_threads(),
        "plan": format_plan(result["plan"]),
        "embedding_hbm_bandwidth": _embedding_hbm_bandwidth(spec, rank, device, clock, result, table_shapes),
    }


def _embedding_hbm_bandwidth(
    spec: BenchSpec, rank: int, device: torch.device, clock: StepClock, result: dict[str, Any],
    table_shapes: dict[str, tuple[int, int]],
) -> dict[str, Any] | None:
    """The embedding kernels' share of the HBM bandwidth (see measure.embedding_bytes_per_step): on a
    GPU run with profiled steps only, where the profiler gives the kernels' time on the GPU."""
    if device.type != "cuda" or clock.phases_ms is None or "device_ms" not in clock.phases_ms:
        return None
    model = spec.model_args()
    ids_per_lookup = {table: m for table, m in zip(table_shapes, spec.inputs.pooling_factors())}
    bytes_per_step = embedding_bytes_per_step(
        result["plan"], rank, table_shapes, ids_per_lookup, spec.inputs.batch_size_per_rank, spec.run.world_size,
        model["sparse_optimizer"],
    )  # fmt: skip
    topology = resolve_topology(spec.strategy.get("topology", "auto"), spec.strategy.get("topology_overrides"), device)
    device_ms = clock.phases_ms["device_ms"][EMBEDDING]
    return {
        "share": hbm_bandwidth_share(bytes_per_step, device_ms, topology.hbm_bw_gb_per_s),
        "estimated_bytes_per_step": bytes_per_step,
        "lookup_device_ms_per_step": device_ms,
        "hbm_bw_gb_per_s": topology.hbm_bw_gb_per_s,
        "topology": topology.name,
    }
