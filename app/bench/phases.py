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
"""

from __future__ import annotations

from pathlib import Path

import torch
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


def phase_table_ms(events: list[FunctionEvent], wall_ms: float, num_steps: int) -> dict[str, float]:
    """Milliseconds per step spent in each phase; the rest of the wall time is Python."""
    totals: dict[str, float] = {phase: 0.0 for phase, _ in PHASES} | {DENSE: 0.0}
    for event in events:
        phase = _innermost_phase(event)
        if phase is None and not (event.name.startswith("aten::") or event.name.startswith("autograd::")):
            continue  # a scope of its own (e.g. "## forward ##"): its ops are counted, not the scope
        totals[phase or DENSE] += event.self_cpu_time_total / 1e3
    per_step = {phase: total / num_steps for phase, total in totals.items()}
    per_step[PYTHON] = max(0.0, wall_ms / num_steps - sum(per_step.values()))
    return per_step


class StepProfiler:
    """Profiles the steps between ``start()`` and ``stop()`` (CPU, and CUDA when used) into a trace file."""

    def __init__(self, trace_path: Path) -> None:
        self.trace_path = trace_path
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(activities=activities)

    def start(self) -> None:
        self.profiler.start()

    def stop(self, wall_ms: float, num_steps: int) -> dict[str, float]:
        self.profiler.stop()
        self.trace_path.parent.mkdir(parents=True, exist_ok=True)
        self.profiler.export_chrome_trace(str(self.trace_path))
        return phase_table_ms(list(self.profiler.events()), wall_ms, num_steps)
