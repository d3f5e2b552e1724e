"""``python -m app.bench.gpu_report`` (``make gpu-report``): the GPU checks, then the GPU bench at 4,096 and
16,384 rows per GPU, within one time budget, every figure in one folder.

Made for a short GPU allocation: each part runs under its own deadline, carved from what is left of the
budget (the checks get half of it, each bench run half of what is left then), so that a hang costs that part
alone; a part that ends early leaves its time to the next. The folder then holds:

- ``gpu-checks.json`` / ``gpu-checks.log``: ``make test-gpu``'s suite on 12 workers, its bench excluded;
- ``bench_4096.jsonl`` / ``bench_16384.jsonl`` (and ``.log``): ``python -m app.bench`` on the
  ``torchrec_reference`` preset, the raw TorchRec loop, the app's defaults and the GPU speed levers as
  variants, with ``gpu_busy_fraction`` and the host time outside kernels of every run (5 profiled steps);
- ``summary.json``: per part its command, deadline, seconds and exit status (124: its deadline ended it),
  and each bench's summary line.

It exits 1 if a part failed or ran out of time. On a machine without a GPU it writes ``summary.json``
saying so and exits 0 at once.

Example::

    python -m app.bench.gpu_report --budget_s 600 --output_dir runs/gpu-report
    python -m app.bench.gpu_report --dry_run true      # the plan: commands and deadlines, nothing run
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from jsonargparse import CLI

ROWS_PER_GPU = (4_096, 16_384)
CHECK_WORKERS = 12
# The checks' share of the budget; each bench run then gets an equal share of what is left.
CHECKS_SHARE = 0.5
# The GPU levers measured beside the app's defaults (float32, eager, sparse_dist) and the raw loop.
GPU_VARIANTS = {
    "app_bf16_cuda_graphs": {"precision": "bf16-mixed", "compile": True, "compile_mode": "reduce-overhead"},
    "app_sparse_dist_lite": {"pipeline": "sparse_dist_lite"},
    "app_fused_sparse_dist": {"pipeline": "fused_sparse_dist"},
}


@dataclass
class Part:
    """One part of the report: a command, its output files and its share of the budget."""

    name: str
    command: list[str]
    output: str  # file of the command's standard output, in the folder
    share: float  # of the budget left when the part starts
    env: dict[str, str]


def plan(python: str, output_dir: Path, bench_args: list[str] | None = None) -> list[Part]:
    """The parts, in the order they run."""
    checks = Part(
        "gpu_checks",
        [python, "-m", "pytest", "-m", "gpu", "tests/gpu", "-rs", "-q", "-n", str(CHECK_WORKERS),
         "--ignore", "tests/gpu/test_gpu_bench.py"],
        "gpu-checks.log", CHECKS_SHARE, {"GPU_REPORT": str(output_dir / "gpu-checks.json")},
    )  # fmt: skip
    parts = [checks]
    for index, rows in enumerate(ROWS_PER_GPU):
        command = [
            python, "-m", "app.bench", "--preset", "torchrec_reference", "--name", f"gpu_{rows}",
            "--run.accelerator", "gpu", "--run.world_size", "1", "--data.batch_size_per_rank", str(rows),
            "--run.warmup_steps", "20", "--run.measured_steps", "100", "--run.profile_steps", "5", "--run.repeats", "1",
            "--run.sides", "[app, raw]", "--app_variants", json.dumps(GPU_VARIANTS),
            "--run.output_dir", str(output_dir / f"bench_{rows}"), *(bench_args or []),
        ]  # fmt: skip
        parts.append(Part(f"bench_{rows}", command, f"bench_{rows}.jsonl", 1 / (len(ROWS_PER_GPU) - index), {}))
    return parts


def no_gpu_reason() -> str | None:
    """Why this machine cannot run the GPU parts, or None."""
    import torch

    if not torch.cuda.is_available():
        return f"no GPU: torch.cuda.is_available() is False (torch {torch.__version__})"
    return None


def run_part(part: Part, output_dir: Path, deadline_s: float) -> dict[str, Any]:
    """Runs ``part`` until it ends or its deadline; its whole process group is ended at the deadline."""
    started = time.monotonic()
    out_path = output_dir / part.output
    # A log keeps both streams; JSON lines keep standard output alone, the log beside them the rest.
    log_path = None if out_path.suffix == ".log" else out_path.with_suffix(".log")
    with open(out_path, "w") as out, open(log_path or os.devnull, "w") as log:
        stderr = subprocess.STDOUT if log_path is None else log
        process = subprocess.Popen(part.command, stdout=out, stderr=stderr, env={**os.environ, **part.env}, start_new_session=True)
        try:
            status = process.wait(timeout=deadline_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            status = 124  # as timeout(1) reports a deadline
    return {"exit_status": status, "seconds": round(time.monotonic() - started, 1)}


def bench_summary(path: Path) -> dict[str, Any] | None:
    """The summary line a bench printed last, or None if it did not get that far."""
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")] if path.is_file() else []
    return next((line for line in reversed(lines) if line.get("summary")), None)


def main(
    budget_s: float = 600.0, output_dir: str = "runs/gpu-report", bench_args: str = "", dry_run: bool = False,
    python: str = sys.executable,
) -> int:
    """Runs the GPU checks and the GPU bench within ``budget_s`` seconds, writing into ``output_dir``.

    Args:
        budget_s: seconds for all parts together (``GPU_BUDGET_S``).
        output_dir: the folder of every figure (``GPU_REPORT_DIR``).
        bench_args: more arguments for both bench runs, as one string (``GPU_BENCH_ARGS``, e.g. "--run.repeats 3").
        dry_run: write and print the plan (commands, shares) without running anything.
        python: the interpreter that runs the parts.
    """
    if budget_s <= 0:
        raise ValueError(f"GPU_BUDGET_S = {budget_s}: give a positive number of seconds")
    folder = Path(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    parts = plan(python, folder, shlex.split(bench_args))
    summary: dict[str, Any] = {"budget_s": budget_s, "output_dir": str(folder), "parts": []}
    reason = None if dry_run else no_gpu_reason()
    if dry_run or reason is not None:
        summary.update(ran=False, reason=reason or "dry run", plan=[asdict(part) for part in parts])
        return _finish(folder, summary)
    ends_at = time.monotonic() + budget_s
    for part in parts:
        deadline_s = max(1.0, (ends_at - time.monotonic()) * part.share)
        record = {"name": part.name, "command": part.command, "deadline_s": round(deadline_s, 1)}
        record.update(run_part(part, folder, deadline_s))
        if part.name.startswith("bench_"):
            record["summary"] = bench_summary(folder / part.output)
        summary["parts"].append(record)
        _write(folder, summary)  # after every part: a later hang or a lost allocation keeps what came before
    summary["ran"] = True
    return _finish(folder, summary)


def _write(folder: Path, summary: dict[str, Any]) -> None:
    (folder / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")


def _finish(folder: Path, summary: dict[str, Any]) -> int:
    _write(folder, summary)
    if not summary.get("ran"):
        print(f"gpu-report: {summary['reason']}; nothing ran ({folder / 'summary.json'})")
        return 0
    for part in summary["parts"]:
        print(f"gpu-report: {part['name']}: exit {part['exit_status']} after {part['seconds']} s (deadline {part['deadline_s']} s)")
    print(f"gpu-report: every figure in {folder}")
    return 0 if all(part["exit_status"] == 0 for part in summary["parts"]) else 1


if __name__ == "__main__":
    try:
        raise SystemExit(CLI(main, as_positional=False))
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
