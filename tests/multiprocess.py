"""Runs the real CLI in N local processes (gloo), the way torchrun would, and collects what each rank saw.

Each worker sets the launcher variables (MASTER_ADDR/PORT, LOCAL_RANK, NODE_RANK), calls
``cli_main`` with the given arguments, then lets ``inspect(cli) -> dict`` read the trained objects
on that rank; the dicts come back to the test indexed by rank.
"""

from __future__ import annotations

import os
import pickle
import socket
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

Inspect = Callable[[Any], dict[str, Any]]

# configs/demo.yaml's training settings before its quality settings (docs/quality.md), for tests built on
# the demo whose exact values, steps or validation counts were worked out with them: row-wise Adagrad, no
# per-id bias, no frequency threshold, one validation per epoch, no early stopping (Lightning's defaults).
DEMO_BEFORE_QUALITY_SETTINGS = [
    "--model.first_order", "false", "--model.sparse_optimizer", "row_wise_adagrad",
    "--data.frequency_threshold", "0", "--trainer.val_check_interval", "1.0",
    "--early_stopping.monitor", "null", "--early_stopping.mode", "min",
]  # fmt: skip


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cli_worker(rank: int, world_size: int, port: int, args: list[str], inspect: Inspect | None, out_dir: str) -> None:
    """One rank of `python -m app <args>` (a spawned process): its inspect result, or its error, pickled
    into out_dir for the test. Shared with tests/gpu/gpu_runs.py."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), NODE_RANK="0", APP_TRACEBACK="1"
    )
    result: dict[str, Any]
    try:
        from app.cli import cli_main

        cli = cli_main(args + ["--trainer.devices", str(world_size)])
        result = inspect(cli) if inspect else {}
    except BaseException as error:  # report to the test instead of dying silently
        result = {"error": f"{type(error).__name__}: {error}\n{traceback.format_exc()}"}
    Path(out_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))


def run_on_ranks(world_size: int, args: list[str], tmp_path: Path, inspect: Inspect | None = None) -> list[dict]:
    """Runs ``python -m app <args>`` on ``world_size`` spawned processes; returns each rank's inspect result."""
    out_dir = tmp_path / f"ranks{world_size}_{free_port()}"
    out_dir.mkdir(parents=True)
    mp.start_processes(
        cli_worker, args=(world_size, free_port(), args, inspect, str(out_dir)), nprocs=world_size, start_method="spawn"
    )
    results = [pickle.loads((out_dir / f"rank{rank}.pkl").read_bytes()) for rank in range(world_size)]
    for rank, result in enumerate(results):
        assert "error" not in result, f"rank {rank} failed:\n{result['error']}"
    return results
