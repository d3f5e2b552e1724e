"""``make gpu-report``: on a machine without a GPU it says so, writes its summary with the plan it would
run and exits 0 at once; each part runs under its own deadline, a hang ending that part alone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from app.bench.gpu_report import Part, run_part

REPO = Path(__file__).resolve().parents[2]


def test_make_gpu_report_without_a_gpu_writes_its_plan_and_exits_cleanly(tmp_path):
    result = subprocess.run(
        ["make", "--no-print-directory", "-o", ".venv/.installed", "gpu-report", f"PY={sys.executable}",
         f"GPU_REPORT_DIR={tmp_path}", "GPU_BUDGET_S=300", "GPU_BENCH_ARGS=--run.repeats 2"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "\ngpu-report: no GPU: torch.cuda.is_available() is False" in result.stdout  # after make's echo of the command
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["ran"] is False and summary["budget_s"] == 300 and summary["parts"] == []
    checks, *benches = summary["plan"]
    # The checks on 12 workers without their bench, their JSON report in the folder; half the budget.
    assert checks["command"][-5:] == ["-q", "-n", "12", "--ignore", "tests/gpu/test_gpu_bench.py"] and checks["share"] == 0.5
    assert checks["env"] == {"GPU_REPORT": str(tmp_path / "gpu-checks.json")}
    # Then the bench at 4,096 and 16,384 rows per GPU: half of what is left, then all of the rest.
    assert [(b["name"], b["output"], b["share"]) for b in benches] == [
        ("bench_4096", "bench_4096.jsonl", 0.5), ("bench_16384", "bench_16384.jsonl", 1.0)
    ]
    for bench, rows in zip(benches, ("4096", "16384")):
        command = bench["command"]
        assert command[1:5] == ["-m", "app.bench", "--preset", "torchrec_reference"] and command[-2:] == ["--run.repeats", "2"]
        assert command[command.index("--data.batch_size_per_rank") + 1] == rows
        assert command[command.index("--run.accelerator") + 1] == "gpu" and "--run.profile_steps" in command


def test_a_part_that_hangs_is_ended_at_its_deadline_and_keeps_what_it_wrote(tmp_path):
    hangs = Part("hangs", [sys.executable, "-c", "import signal; print('started', flush=True); signal.pause()"], "hangs.jsonl", 1.0, {})
    assert run_part(hangs, tmp_path, deadline_s=2)["exit_status"] == 124  # timeout(1)'s status for a deadline
    assert (tmp_path / "hangs.jsonl").read_text() == "started\n"
    ends = Part("ends", [sys.executable, "-c", "import sys; print('{}'); sys.exit(3)"], "ends.log", 1.0, {})
    assert run_part(ends, tmp_path, deadline_s=60)["exit_status"] == 3
    assert (tmp_path / "ends.log").read_text() == "{}\n"


def test_the_gpu_bench_commands_parse_as_the_bench_reads_them(tmp_path):
    # A typo here would cost a GPU allocation: each bench part's arguments go through the bench's own parser.
    from app.bench import cli as bench_cli
    from app.bench.gpu_report import GPU_VARIANTS, plan

    for part in plan(sys.executable, tmp_path)[1:]:
        spec = bench_cli.spec_from(bench_cli.build_parser().parse_args(bench_cli.expand_presets(part.command[3:])))
        assert spec.run.accelerator == "gpu" and spec.run.profile_steps == 5 and spec.run.sides == ["app", "raw"]
        assert spec.app_variants == GPU_VARIANTS and spec.data.batch_size_per_rank == int(part.name.removeprefix("bench_"))
