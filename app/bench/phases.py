"""Where a step's time goes: a PyTorch profiler trace of a few steps and a table of time per phase.

Phases are recognised by the names the libraries already give their work (no extra annotations in
the code measured): the DataLoader's ``enumerate(DataLoader)`` scope, TorchRec's input all-to-all
(``all2all``, ``sparse_data_dist``), FBGEMM's embedding kernels (forward, and backward with the fused
optimizer update), DDP's gradient all-reduce, the optimizers' ``Optimizer.step``/``zero_grad``, and
every other aten op (the dense forward and backward). An op counts towards the innermost phase it
runs in, so the aten ops inside ``Optimizer.step`` are optimizer time; a combined optimizer's step,
inside which Lightning runs forward and backward as the step's closure, is not a phase of its own.
What no op accounts for is Python: the training loop itself, and on the app's side what Lightning
does around each step.

On GPUs the host's time says little about the device's: ops return once their kernels are queued,
so the host's time per phase is launch cost, and time the device spends is spent later, while the
host waits wherever it next synchronises (inside an op, or outside any op, which would read as
"python"). There the table is two tables: ``host_ms``, the host's time per phase with the rest
named for what it may be (Python, or a wait for the device outside any op), and ``device_ms``, the
time of the kernels each phase's ops launched (the profiler's GPU-side time, attributed through the
op that launched them; kernels on different streams overlap, so they may add up to more than the
wall time). The clock synchronises with the device at the end of the profiled steps, so that the
wall time covers the kernels they queued.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent

# (phase, name fragments), in the order a name is tested.
PHASES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("data loading", ("enumerate(DataLoader)",)),
    ("input dist (all-to-all)", ("all2all", "alltoall", "all_to_all", "sparse_data_dist")),
    ("embedding lookup (fwd, bwd + fused update)", ("fbgemm::", "SplitLookupFunction", "split_embedding")),
    ("gradient all-reduce", ("allreduce", "all_reduce")),
    ("optimizer", ("Optimizer.step", "Optimizer.zero_grad", "## optimizer", "## zero_grad")),
)
DENSE = "dense forward/backward"
PYTHON = "python: loop, hooks, framework"
HOST_REST_ON_GPU = "python, or waiting for the GPU outside any op"
EMBEDDING = PHASES[2][0]


def _phase_of(name: str) -> str | None:
    if "CombinedOptimizer" in name:
        return None
    for phase, fragments in PHASES:
        if any(fragment in name for fragment in fragments):
            return phase
    return None


def _innermost_phase(event: FunctionEvent) -> str | None:
    node = event
    while node is not None:
        phase = _phase_of(node.name)
        if phase is not None:
            return phase
        node = node.cpu_parent
    return None


def _in_an_op(event: FunctionEvent) -> bool:
    """Whether the event is an aten/autograd op or runs inside one (e.g. a CUDA runtime call it makes)."""
    node = event
    while node is not None:
        if node.name.startswith("aten::") or node.name.startswith("autograd::"):
            return True
        node = node.cpu_parent
    return False


def _phase_totals_ms(events: list[FunctionEvent], time_of) -> dict[str, float]:
    """``time_of(event)`` in ms summed per phase over the host-side events; a scope of its own (e.g.
    "## forward ##") counts only through its ops, and device-side events only through the host op
    that launched them (its time on the GPU)."""
    totals: dict[str, float] = {phase: 0.0 for phase, _ in PHASES} | {DENSE: 0.0}
    for event in events:
        if event.device_type != DeviceType.CPU:
            continue
        phase = _innermost_phase(event)
        if phase is None and not _in_an_op(event):
            continue
        totals[phase or DENSE] += time_of(event) / 1e3
    return totals


def phase_table_ms(events: list[FunctionEvent], wall_ms: float, num_steps: int, device_time: bool = False) -> dict:
    """Milliseconds per step spent in each phase; the rest of the wall time is Python. With
    ``device_time`` (a GPU run): ``{"host_ms": ..., "device_ms": ..., "wall_ms": ...}``, see the module."""
    host = {phase: total / num_steps for phase, total in _phase_totals_ms(events, lambda e: e.self_cpu_time_total).items()}
    rest_ms = max(0.0, wall_ms / num_steps - sum(host.values()))
    if not device_time:
        return host | {PYTHON: rest_ms}
    device = _phase_totals_ms(events, lambda e: e.self_device_time_total)
    return {
        "host_ms": host | {HOST_REST_ON_GPU: rest_ms},
        "device_ms": {phase: total / num_steps for phase, total in device.items()},
        "wall_ms": wall_ms / num_steps,
    }


def kernel_busy_ms(events: list[FunctionEvent]) -> float:
    """Milliseconds in which at least one device kernel ran: the union of the kernels' time ranges, so
    that kernels overlapping on several streams count once (0 for a profile without device events)."""
    spans = sorted(
        (e.time_range.start, e.time_range.end) for e in events if e.device_type in (DeviceType.CUDA, DeviceType.PrivateUse1)
    )  # fmt: skip
    busy_us, covered_until = 0.0, float("-inf")
    for start, end in spans:
        if end > covered_until:
            busy_us += end - max(start, covered_until)
            covered_until = end
    return busy_us / 1e3


class StepProfiler:
    """Profiles the steps between ``start()`` and ``stop()`` (the host, and the device's kernels on a
    GPU run) into a trace file."""

    def __init__(self, trace_path: Path, device: torch.device) -> None:
        self.trace_path = trace_path
        # By the run's device, not by what the machine has: a CPU run on a GPU machine gets the CPU table.
        self.device_time = device.type == "cuda"
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device_time:
            activities.append(torch.profiler.ProfilerActivity.CUDA)  # ROCm too: HIP kernels are reported as CUDA
        self.profiler = torch.profiler.profile(activities=activities)
        self.kernel_busy_ms_per_step: float | None = None  # set by stop() on a GPU run

    def start(self) -> None:
        self.profiler.start()

    def stop(self, wall_ms: float, num_steps: int) -> dict:
        self.profiler.stop()
        self.trace_path.parent.mkdir(parents=True, exist_ok=True)
        self.profiler.export_chrome_trace(str(self.trace_path))
        events = list(self.profiler.events())
        if self.device_time:
            self.kernel_busy_ms_per_step = kernel_busy_ms(events) / num_steps
        return phase_table_ms(events, wall_ms, num_steps, self.device_time)
