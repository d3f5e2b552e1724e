"""What a benchmark run measures on each rank: step end times, memory, and the memory it should need.

Step times are the intervals between the ends of consecutive steps, so they include everything a
step costs: fetching the batch, the input all-to-all, forward, backward, the optimizer and, on the
app's side, what Lightning adds around them. On GPUs the clock is synchronised with the device at
the start and end of the measured steps (and of the profiled steps) only, so that per-step syncs do
not break a pipeline's overlap.

Memory: resident memory (RSS) on every device; on GPUs, where the tables live in HBM, also the HBM
the caching allocator held at the start of the measured steps and its peak over them (the peak is
reset after warm-up, so that set-up and the first steps' allocations do not count), and that HBM
peak is what is compared with what a rank must hold.
"""

from __future__ import annotations

import resource
import statistics
import time
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torchrec.datasets.criteo import DEFAULT_CAT_NAMES
from torchrec.distributed.types import ParameterSharding, ShardingPlan
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from app.bench.phases import StepProfiler
from app.criteo import NUM_DENSE
from app.distributed.sharding import UVM_CACHING_KERNEL, cache_load_factor, keeps_rows_in_host_memory
from app.model.dlrm import build_dlrm, build_dlrm_arguments

# Optimizer state per table element, as a multiple of the table itself (row-wise Adagrad keeps one
# value per row, counted separately).
_STATE_PER_ELEMENT = {"adagrad": 1, "adam": 2, "sgd": 0, "row_wise_adagrad": 0}
_FLOAT32_BYTES = 4


class StepClock:
    """Records when each step ends: ``warmup_steps``, then the measured steps, then (with a profiler)
    ``profile_steps`` more under the profiler, so that profiling never slows the measured steps."""

    def __init__(
        self, warmup_steps: int, measured_steps: int, device: torch.device,
        profiler: StepProfiler | None = None, profile_steps: int = 0,
    ) -> None:  # fmt: skip
        self.warmup_steps, self.measured_steps, self.device = warmup_steps, measured_steps, device
        self.profiler, self.profile_steps = profiler, profile_steps
        self.step_end_s: list[float] = []
        self.rss_at_setup_bytes = 0
        self.phases_ms: dict[str, Any] | None = None
        self.kernel_busy_ms_per_step: float | None = None  # on GPUs, from the profiled steps
        self.hbm: dict[str, int] = {}  # on GPUs: HBM at the start of the measured steps and its peak over them

    def mark_setup(self) -> None:
        """Call once the process group exists and before the model is built: memory grows from here."""
        self.rss_at_setup_bytes = rss_bytes()

    def step_ended(self) -> None:
        ended = len(self.step_end_s) + 1
        measured_end = self.warmup_steps + self.measured_steps
        profiled_end = measured_end + self.profile_steps if self.profiler is not None else None
        on_gpu = self.device.type == "cuda"
        if on_gpu and ended in (self.warmup_steps, measured_end, profiled_end):
            # Queued kernels finish inside the window they belong to; CUDA only: a CPU step is done when it returns.
            torch.cuda.synchronize(self.device)
        self.step_end_s.append(time.perf_counter())
        if on_gpu and ended == self.warmup_steps:
            torch.cuda.reset_peak_memory_stats(self.device)  # the peak of the measured steps, not of set-up
            self.hbm["hbm_allocated_at_measure_start_bytes"] = torch.cuda.memory_allocated(self.device)
        if on_gpu and ended == measured_end:
            self.hbm["peak_hbm_allocated_bytes"] = torch.cuda.max_memory_allocated(self.device)
            self.hbm["peak_hbm_reserved_bytes"] = torch.cuda.max_memory_reserved(self.device)
        if self.profiler is not None and ended == measured_end:
            self.profiler.start()
        if ended == profiled_end:
            wall_ms = (self.step_end_s[-1] - self.step_end_s[measured_end - 1]) * 1e3
            self.phases_ms = self.profiler.stop(wall_ms, self.profile_steps)  # type: ignore[union-attr]
            self.kernel_busy_ms_per_step = self.profiler.kernel_busy_ms_per_step  # type: ignore[union-attr]

    def step_times_s(self) -> list[float]:
        """Durations of the measured steps: the first measured step starts when the last warm-up step ends."""
        ends = self.step_end_s[self.warmup_steps - 1 : self.warmup_steps + self.measured_steps]
        return [later - earlier for earlier, later in zip(ends, ends[1:])]


class StepClockCallback(Callback):
    """A StepClock driven by Lightning's batch-end hook (the app's side)."""

    def __init__(self, clock: StepClock) -> None:
        self.clock = clock

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.clock.mark_setup()  # Lightning calls this after the process group starts, before sharding

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.clock.step_ended()


def rss_bytes() -> int:
    """Resident memory of this process now (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_memory(device: torch.device, rss_at_setup_bytes: int, hbm: dict[str, int] | None = None) -> dict[str, Any]:
    """Peak resident memory of this process and its growth from the moment the process group existed
    and the model was not built yet (what the model and training take); on GPUs also the clock's HBM
    figures (``hbm``). ``basis`` names the figure compared with what the rank must hold: ``rss`` on
    CPU, ``hbm`` on GPUs, where the tables, their state and the batches live in HBM and RSS holds
    the CUDA context and libraries instead."""
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    memory: dict[str, Any] = {"peak_rss_bytes": peak_rss, "rss_growth_bytes": peak_rss - rss_at_setup_bytes}
    if device.type == "cuda":
        return {**memory, **(hbm or {}), "basis": "hbm"}
    return {**memory, "basis": "rss"}


def growth_over_expected(memory: dict[str, Any]) -> float:
    """The memory a rank used over what it must hold: peak HBM over the measured steps on GPUs, RSS
    growth on CPU (see ``peak_memory``)."""
    used = memory["peak_hbm_allocated_bytes"] if memory["basis"] == "hbm" else memory["rss_growth_bytes"]
    return used / memory["expected_bytes"]


def expected_memory_bytes(
    plan: ShardingPlan, rank: int, table_shapes: dict[str, tuple[int, int]], sparse_optimizer: str,
    dense_parameters: int, dense_optimizer: str, batch_bytes: int, step_bytes: int = 0, mapped_data_bytes: int = 0,
    global_batch_size: int = 0,
) -> int:
    """What rank ``rank`` must hold: its table shards and their optimizer state (a full copy of a
    replicated table, with its gradient; of a table in host memory, what FBGEMM keeps in HBM), the
    dense model with its gradients, DDP's gradient buckets and optimizer state, a few batches, what a step holds besides (``step_bytes``: activations and
    their gradients, see autograd_working_set_bytes), the pooled lookups its shards compute for the
    whole global batch and their gradients (the all-to-all's send and receive buffers), and the pages
    of memory-mapped data files it reads (resident memory counts them)."""
    table_bytes = sharded_columns = 0
    for module_plan in plan.plan.values():
        for table, sharding in module_plan.items():  # type: ignore[union-attr]
            rows, cols = table_shapes[table]
            if sharding.sharding_spec is None:  # replicated on every rank (a dense kernel), with its gradient
                state = _STATE_PER_ELEMENT[sparse_optimizer]
                table_bytes += 2 * rows * cols * _FLOAT32_BYTES * (1 + state) + rows * _row_state_bytes(sparse_optimizer)
                continue
            for shard in sharding.sharding_spec.shards:
                if shard.placement.rank() == rank:
                    rows, cols = shard.shard_sizes
                    table_bytes += _shard_bytes(rows, cols, sharding, sparse_optimizer)
                    sharded_columns += cols
    dense_bytes = dense_parameters * _FLOAT32_BYTES * (3 + _STATE_PER_ELEMENT[dense_optimizer])
    lookup_bytes = 2 * global_batch_size * sharded_columns * _FLOAT32_BYTES
    return round(table_bytes) + dense_bytes + 3 * batch_bytes + step_bytes + lookup_bytes + mapped_data_bytes


def _row_state_bytes(sparse_optimizer: str) -> int:
    return _FLOAT32_BYTES if sparse_optimizer == "row_wise_adagrad" else 0


def _shard_bytes(rows: int, cols: int, sharding: ParameterSharding, sparse_optimizer: str) -> float:
    """A table shard's weights and optimizer state in the memory the bench compares (HBM on GPUs).

    FBGEMM's UVM kernels keep the weights, and state kept per element, in host memory, and the
    row-wise state in HBM (``construct_split_state``); ``fused_uvm_caching`` adds its HBM cache: a load
    factor of the rows, each slot with the row and two int64 of cache state (LRU), and an int32 per
    row mapping it to its table.
    """
    state_bytes = rows * _row_state_bytes(sparse_optimizer)
    if sharding.compute_kernel == UVM_CACHING_KERNEL:
        return cache_load_factor(sharding) * rows * (cols * _FLOAT32_BYTES + 16) + rows * 4 + state_bytes
    if keeps_rows_in_host_memory(sharding.compute_kernel):  # fused_uvm: no cache
        return state_bytes
    return rows * cols * _FLOAT32_BYTES * (1 + _STATE_PER_ELEMENT[sparse_optimizer]) + state_bytes


def embedding_bytes_per_step(
    plan: ShardingPlan, rank: int, table_shapes: dict[str, tuple[int, int]], ids_per_lookup: dict[str, float],
    batch_size_per_rank: int, world_size: int, sparse_optimizer: str,
) -> int:
    """An estimate of the bytes rank ``rank``'s embedding kernels move in HBM per training step: the
    forward reads each looked-up row, writes the pooled bags; the backward with the fused optimizer
    reads the bags' gradients and reads and writes each looked-up row with its optimizer state.

    An upper estimate: ids are counted with repeats (FBGEMM's backward updates each distinct row
    once), and a row-wise shard is taken to receive its share of the ids by its share of the rows
    (exact in expectation for the bench's uniform random ids, not for a real dataset's skewed ones).
    A sharded table's shards see the global batch (after the input all-to-all); a replicated
    (data-parallel) table sees the rank's own batch.
    """
    state = _STATE_PER_ELEMENT[sparse_optimizer]
    total_bytes = 0.0
    for module_plan in plan.plan.values():
        for table, sharding in module_plan.items():  # type: ignore[union-attr]
            rows, cols = table_shapes[table]
            if sharding.sharding_spec is None:
                pieces = [(batch_size_per_rank, 1.0, cols)]
            else:
                pieces = [
                    (batch_size_per_rank * world_size, shard.shard_sizes[0] / rows, shard.shard_sizes[1])
                    for shard in sharding.sharding_spec.shards if shard.placement.rank() == rank
                ]  # fmt: skip
            for bags, row_share, shard_cols in pieces:
                ids = bags * ids_per_lookup[table] * row_share
                row_bytes = shard_cols * _FLOAT32_BYTES
                row_and_state_bytes = row_bytes * (1 + state) + (_FLOAT32_BYTES if sparse_optimizer == "row_wise_adagrad" else 0)
                total_bytes += ids * row_bytes + 2 * bags * row_bytes + 2 * ids * row_and_state_bytes
    return int(total_bytes)


def hbm_bandwidth_share(bytes_per_step: int, lookup_device_ms_per_step: float, hbm_bw_gb_per_s: float) -> float | None:
    """The share of the HBM bandwidth the embedding kernels reach: bytes moved over the time their
    kernels ran, over the bandwidth the topology preset gives; None without kernel time."""
    if lookup_device_ms_per_step <= 0:
        return None
    return bytes_per_step / (lookup_device_ms_per_step / 1e3) / (hbm_bw_gb_per_s * 1e9)


def autograd_working_set_bytes(model_args: dict[str, Any], batch_size: int, pooling_factors: list[float]) -> int:
    """Bytes a training step holds besides its inputs: the activations autograd saves for backward and,
    as much again, their gradients in backward.

    Measured, not modelled: one forward of the same DLRM on a batch of this size, with tables of one
    row (activation sizes do not depend on table rows) and every id 0, counting the tensors autograd
    saves other than parameters.
    """
    rows = [1] * len(pooling_factors)
    dlrm = build_dlrm(**build_dlrm_arguments({**model_args, "num_embeddings_per_feature": rows}), embedding_device="cpu")
    parameters = {p.data_ptr() for p in dlrm.parameters()}
    saved: dict[tuple[int, int], int] = {}

    def count(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.data_ptr() not in parameters:  # a weight (or its transposed view) is not a buffer
            saved[(tensor.data_ptr(), tensor.numel())] = tensor.numel() * tensor.element_size()
        return tensor

    ids_per_row = [max(1, round(p)) for p in pooling_factors]
    sparse = KeyedJaggedTensor.from_lengths_sync(
        keys=list(DEFAULT_CAT_NAMES[: len(rows)]),
        values=torch.zeros(batch_size * sum(ids_per_row), dtype=torch.int64),
        lengths=torch.tensor(ids_per_row, dtype=torch.int32).repeat_interleave(batch_size),
    )
    with torch.autograd.graph.saved_tensors_hooks(count, lambda tensor: tensor):
        dlrm(torch.zeros(batch_size, NUM_DENSE), sparse)
    return 2 * sum(saved.values())


# The fields ``gpu_busy`` adds to a run's line that the summary gives a median of.
BUSY_FIELDS = ("gpu_busy_fraction", "host_ms_per_step_outside_kernels")


def gpu_busy(device_type: str, profile_steps: int, step_times_s: list[float], kernel_busy_ms_per_step: float | None) -> dict[str, Any]:
    """How much of a measured step the device's kernels fill, and the host time left around them.

    ``gpu_busy_fraction``: the kernels' busy time per step (the union of their time ranges in the
    profiled steps, ``phases.kernel_busy_ms``) over the mean wall time of the measured steps;
    ``host_ms_per_step_outside_kernels``: that wall time less the kernels' time, the part of a step the
    host alone accounts for (launches, Python, waits). Both null, with ``gpu_busy_reason`` saying why,
    on CPU (no separate device: the whole step is host time, ``step_ms_*``) and on a GPU run without
    profiled steps (``run.profile_steps``), which alone give the kernels' time."""
    if device_type != "cuda":
        reason = "cpu run: no device kernels apart from the host, the whole step is host time (step_ms_*)"
    elif not profile_steps or kernel_busy_ms_per_step is None:
        reason = "no profiled steps: set run.profile_steps (e.g. 5) for the kernels' time"
    else:
        step_ms = sum(step_times_s) / len(step_times_s) * 1e3
        return {
            "gpu_busy_fraction": kernel_busy_ms_per_step / step_ms,
            "host_ms_per_step_outside_kernels": max(0.0, step_ms - kernel_busy_ms_per_step),
            "kernel_ms_per_step": kernel_busy_ms_per_step,
            "gpu_busy_reason": None,
        }
    return {"gpu_busy_fraction": None, "host_ms_per_step_outside_kernels": None, "kernel_ms_per_step": None, "gpu_busy_reason": reason}


def step_statistics(step_times_s: list[float], samples_per_step: list[int]) -> dict[str, float]:
    """Samples/s (median and mean over measured steps) and step-time percentiles in ms; each step's
    samples are the rows it trained on all ranks (a dataset's last batch of an epoch is short)."""
    if not step_times_s:
        raise ValueError("no measured steps: run.measured_steps must be at least 1")
    rates = [samples / t for samples, t in zip(samples_per_step, step_times_s)]
    quantiles = statistics.quantiles(step_times_s, n=100, method="inclusive") if len(step_times_s) > 1 else [step_times_s[0]] * 99
    return {
        "samples_per_s_median": statistics.median(rates),
        "samples_per_s_mean": sum(samples_per_step) / sum(step_times_s),
        "step_ms_p50": quantiles[49] * 1e3,
        "step_ms_p90": quantiles[89] * 1e3,
        "step_ms_p99": quantiles[98] * 1e3,
    }
