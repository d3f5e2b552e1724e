"""What a benchmark run measures on each rank: step end times, memory, and the memory it should need.

Step times are the intervals between the ends of consecutive steps, so they include everything a
step costs: fetching the batch, the input all-to-all, forward, backward, the optimizer and, on the
app's side, what Lightning adds around them. On GPUs the clock is synchronised with the device at
the first and last measured step only, so that per-step syncs do not break the overlap of a pipeline.
"""

from __future__ import annotations

import resource
import statistics
import time
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torchrec.distributed.types import ShardingPlan

# Optimizer state per table element, as a multiple of the table itself (row-wise Adagrad keeps one
# value per row, counted separately).
_STATE_PER_ELEMENT = {"adagrad": 1, "adam": 2, "sgd": 0, "row_wise_adagrad": 0}
_FLOAT32_BYTES = 4


class StepClock:
    """Records when each step ends; steps from ``warmup_steps`` on are the measured ones."""

    def __init__(self, warmup_steps: int, device: torch.device) -> None:
        self.warmup_steps = warmup_steps
        self.device = device
        self.step_end_s: list[float] = []

    def step_ended(self, last_step: bool = False) -> None:
        if self.device.type == "cuda" and (len(self.step_end_s) == self.warmup_steps - 1 or last_step):
            torch.cuda.synchronize(self.device)
        self.step_end_s.append(time.perf_counter())

    def step_times_s(self) -> list[float]:
        """Durations of the measured steps: the first measured step starts when the last warm-up step ends."""
        ends = self.step_end_s[max(0, self.warmup_steps - 1) :]
        return [later - earlier for earlier, later in zip(ends, ends[1:])]


class StepClockCallback(Callback):
    """A StepClock driven by Lightning's batch-end hook (the app's side)."""

    def __init__(self, clock: StepClock) -> None:
        self.clock = clock

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.clock.step_ended(last_step=trainer.global_step >= (trainer.max_steps or 0))


def rss_bytes() -> int:
    """Resident memory of this process now (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_memory(device: torch.device, rss_at_start_bytes: int) -> dict[str, int]:
    """Peak resident memory of this process (and peak device memory on GPUs), and the growth since set-up."""
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    memory = {"peak_rss_bytes": peak_rss, "rss_growth_bytes": peak_rss - rss_at_start_bytes}
    if device.type == "cuda":
        memory["peak_device_bytes"] = torch.cuda.max_memory_allocated(device)
    return memory


def expected_memory_bytes(
    plan: ShardingPlan, rank: int, table_shapes: dict[str, tuple[int, int]], sparse_optimizer: str,
    dense_parameters: int, dense_optimizer: str, batch_bytes: int,
) -> int:
    """What rank ``rank`` must hold: its table shards and their optimizer state (a full copy of a
    replicated table, with its gradient), the dense model with its gradients, DDP's gradient buckets
    and optimizer state, and a few batches."""
    table_elements = row_count = 0
    for module_plan in plan.plan.values():
        for table, sharding in module_plan.items():  # type: ignore[union-attr]
            rows, cols = table_shapes[table]
            if sharding.sharding_spec is None:  # replicated on every rank, with its gradient
                table_elements += 2 * rows * cols
                row_count += rows
                continue
            for shard in sharding.sharding_spec.shards:
                if shard.placement.rank() == rank:
                    rows, cols = shard.shard_sizes
                    table_elements += rows * cols
                    row_count += rows
    table_bytes = table_elements * _FLOAT32_BYTES * (1 + _STATE_PER_ELEMENT[sparse_optimizer])
    if sparse_optimizer == "row_wise_adagrad":
        table_bytes += row_count * _FLOAT32_BYTES
    dense_bytes = dense_parameters * _FLOAT32_BYTES * (3 + _STATE_PER_ELEMENT[dense_optimizer])
    return table_bytes + dense_bytes + 3 * batch_bytes


def step_statistics(step_times_s: list[float], global_batch_size: int) -> dict[str, float]:
    """Samples/s (median and mean over measured steps) and step-time percentiles in ms."""
    if not step_times_s:
        raise ValueError("no measured steps: run.measured_steps must be at least 1")
    rates = [global_batch_size / t for t in step_times_s]
    quantiles = statistics.quantiles(step_times_s, n=100, method="inclusive") if len(step_times_s) > 1 else [step_times_s[0]] * 99
    return {
        "samples_per_s_median": statistics.median(rates),
        "samples_per_s_mean": global_batch_size * len(step_times_s) / sum(step_times_s),
        "step_ms_p50": quantiles[49] * 1e3,
        "step_ms_p90": quantiles[89] * 1e3,
        "step_ms_p99": quantiles[98] * 1e3,
    }
