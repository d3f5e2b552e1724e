"""The GPU suite (``make test-gpu``): every test here is marked ``gpu`` and skips, with the reason,
where there is no usable GPU; the session writes a JSON report of the machine, the library versions
and each check's outcome and figures.

A usable GPU: ``torch.cuda.is_available()`` (CUDA, or ROCm, which torch also calls ``cuda``; the
report says which from ``torch.version.cuda`` / ``torch.version.hip``) and an fbgemm_gpu with GPU
kernels (the CPU build, fbgemm-gpu-cpu, has none: TorchRec's fused tables could not run).

The report goes to ``runs/gpu-report.json``, or to ``--gpu-report PATH`` / ``$GPU_REPORT``. It is
written when the run selected the gpu marker (``-m gpu``, as ``make test-gpu`` does) or a path was
given, so that ``make test`` (which collects and skips these tests too) leaves no file behind.
Figures come from each test's ``record_property(name, value)`` (pytest's own fixture; the values
must be JSON-serialisable).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

from tests.gpu.gpu_env import library_version, no_gpu_reason

DEFAULT_REPORT = Path("runs/gpu-report.json")
REPORT_ENV = "GPU_REPORT"
PACKAGES = ("torch", "fbgemm-gpu", "fbgemm-gpu-cpu", "fbgemm-gpu-nightly", "torchrec", "lightning", "torchmetrics", "numpy")

_results: dict[str, dict[str, Any]] = {}


def pytest_addoption(parser: pytest.Parser) -> None:
    # Registered when pytest starts from tests/gpu (make test-gpu); under a plain `pytest` this file is
    # read later and the option is not parsed: the environment variable still works there.
    parser.addoption("--gpu-report", default=None, help=f"where the GPU suite writes its JSON report (default {DEFAULT_REPORT}; or ${REPORT_ENV})")


@pytest.fixture(scope="session", autouse=True)
def _gpu_or_skip() -> None:
    # Session-scoped so that it comes before the session fixtures that run the app (pytest sets up
    # autouse fixtures first within a scope, and wider scopes first): without a GPU nothing runs.
    reason = no_gpu_reason()
    if reason is not None:
        pytest.skip(reason)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Each test's outcome (a failed set-up or teardown counts), reason and recorded figures."""
    entry = _results.setdefault(report.nodeid, {"outcome": "passed", "figures": {}})
    entry["figures"].update({name: value for name, value in report.user_properties})
    if report.skipped:
        entry["outcome"] = "skipped"
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        entry["reason"] = reason.removeprefix("Skipped: ")
    elif report.failed:
        entry["outcome"] = "failed"
        entry["reason"] = f"{report.when}: {report.longreprtext[-3000:]}"
    if report.when == "call" and report.passed:
        entry["duration_s"] = round(report.duration, 1)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    path = _report_path(session.config)
    if path is None or not _results:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "written": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "exit_status": int(exitstatus),
        "summary": {o: sum(r["outcome"] == o for r in _results.values()) for o in ("passed", "failed", "skipped")},
        "machine": machine_description(),
        "versions": library_versions(),
        "checks": _results,
    }
    path.write_text(json.dumps(report, indent=1, default=str) + "\n")
    terminal = session.config.pluginmanager.get_plugin("terminalreporter")
    if terminal is not None:
        terminal.write_line(f"GPU report: {path}")


def _report_path(config: pytest.Config) -> Path | None:
    given = config.getoption("--gpu-report", default=None) or os.environ.get(REPORT_ENV)
    if given:
        return Path(given)
    return DEFAULT_REPORT if (config.getoption("markexpr", default="") or "").strip() == "gpu" else None


def machine_description() -> dict[str, Any]:
    """The GPUs (name, memory, capability), the runtime torch was built for, the driver, and the host."""
    import torch

    description: dict[str, Any] = {
        "host": platform.node(),
        "python": platform.python_version(),
        "cpu_cores": len(os.sched_getaffinity(0)),
        "gpu_runtime": "rocm" if torch.version.hip else "cuda" if torch.version.cuda else None,
        "torch_cuda": torch.version.cuda,
        "torch_hip": torch.version.hip,
        "gpu_available": torch.cuda.is_available(),
        "no_gpu_reason": no_gpu_reason(),
    }
    if not torch.cuda.is_available():
        return description
    devices = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        devices.append({
            "index": index, "name": props.name, "total_memory_bytes": props.total_memory,
            "capability": f"{props.major}.{props.minor}", "multi_processor_count": props.multi_processor_count,
            **({"gcn_arch": props.gcnArchName} if getattr(props, "gcnArchName", "") else {}),
        })  # fmt: skip
    description.update(gpu_count=len(devices), gpus=devices, driver=_driver_version())
    try:  # torch's bundled NCCL (RCCL on ROCm): a tuple in recent torch, an int in older ones
        nccl = torch.cuda.nccl.version()
        description["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    except (AttributeError, RuntimeError):
        description["nccl"] = None
    return description


def _driver_version() -> str | None:
    """The GPU driver, from nvidia-smi or rocm-smi when present (torch does not report it); None otherwise."""
    for command in (["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], ["rocm-smi", "--showdriverversion"]):
        if shutil.which(command[0]) is None:
            continue
        try:
            output = subprocess.run(command, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            continue
        if output:
            return f"{command[0]}: {output.splitlines()[0] if command[0] == 'nvidia-smi' else output[-200:]}"
    return None


def library_versions() -> dict[str, str]:
    return {package: version for package in PACKAGES if (version := library_version(package))}


# ---- the runs several checks share (each runs once per session, only where a GPU is) ----------------


@pytest.fixture(scope="session")
def app_runs(_gpu_or_skip, tmp_path_factory):
    """``app_runs(name, world_size, args, prepare=None)``: ``python -m app`` run once per name in the
    session, in a folder of its own (``{root}`` in ``args``; ``prepare(root)`` is called first), each
    rank's ``trained_state``. Checks that compare two runs share the runs they have in common."""
    from tests.gpu.gpu_runs import run_app, trained_state

    done: dict[str, list[dict]] = {}

    def run(name: str, world_size: int, args: list[str], prepare=None) -> list[dict]:
        if name not in done:
            root = tmp_path_factory.mktemp(name)
            if prepare is not None:
                prepare(root)
            done[name] = run_app(world_size, [str(a).replace("{root}", str(root)) for a in args], root, trained_state)
        return done[name]

    return run


@pytest.fixture(scope="session")
def reference_args(sample) -> list[str]:
    """The reference fit on one GPU: the CPU suite's tiny model (26 tables x 500 x 8, tests/distributed/test_sharding.py)
    on its 1,536-row sample, 128 rows per step (12 steps per epoch), 2 epochs, validating twice an
    epoch, row-wise Adagrad for the tables and SGD for the MLPs, TorchRec's sparse_dist pipeline
    (``auto`` on GPUs, named here so that the pipeline checks change one setting), the reference
    tables copied in at the start and the training probe recording every step."""
    from tests.gpu.gpu_runs import GPU
    from tests.distributed.test_sharding import fit_args

    return fit_args(sample, Path("{root}"), "table_wise", 128) + GPU + [
        "--model.pipeline", "sparse_dist",
        "--trainer.val_check_interval", "0.5",
        "--trainer.callbacks+=tests.training_probe.TrainingProbe",
    ]  # fmt: skip


@pytest.fixture(scope="session")
def reference(app_runs, reference_args) -> dict:
    (rank0,) = app_runs("reference", 1, reference_args)
    return rank0
