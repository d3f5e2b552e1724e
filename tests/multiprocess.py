"""Runs the real CLI in N local processes (gloo), the way torchrun would, and collects what each rank saw.

Each worker sets the launcher variables (MASTER_ADDR/PORT, LOCAL_RANK, NODE_RANK), calls
``cli_main`` with the given arguments, then lets ``inspect(cli) -> dict`` read the trained objects
on that rank; the dicts come back to the test indexed by rank.

The rendezvous store is hosted by the test process on a port the OS picks (``rendezvous_port``), as
torchrun's agent hosts it, and every rank joins it as a client: no port is chosen "free" and bound
later, when another process may have taken it.
"""

from __future__ import annotations

import itertools
import os
import pickle
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

Inspect = Callable[[Any], dict[str, Any]]

# The ranks are forked from multiprocessing's fork server, which imports the app once per test process:
# a spawned rank spent about 4 s of CPU importing torch, Lightning and TorchRec before its first line,
# a large share of `make test` on 2 cores. The server is a fresh single-threaded process that has
# imported modules and done nothing else (no thread, no CUDA), so forking it is safe; each rank then
# takes the test's environment (``cli_worker``), as a spawned one inherits it. torch.distributed.optim
# too: every fit imports it, and its functional optimizers are TorchScript-compiled on
# import (0.7-1.2 s of CPU per rank, the largest import left after app.cli's).
mp.set_forkserver_preload(["app.cli", "torch.distributed.optim"])

# configs/demo.yaml's training settings before its quality settings (docs/quality.md), for tests built on
# the demo whose exact values, steps or validation counts were worked out with them: row-wise Adagrad at
# 0.05, no per-id bias or pairwise term, no frequency threshold, one validation per epoch, no early
# stopping (Lightning's defaults), and float32 whatever the CPU (unset, the precision is bf16 autocast on
# CPUs with bf16 matrix units: app/train/precision.py). The tests set their own trainer.max_epochs.
DEMO_BEFORE_QUALITY_SETTINGS = [
    "--model.first_order", "false", "--model.second_order", "false", "--trainer.precision", "32-true",
    "--model.sparse_optimizer", "row_wise_adagrad", "--model.sparse_learning_rate", "0.05",
    "--data.frequency_threshold", "0", "--trainer.val_check_interval", "1.0",
    "--early_stopping.monitor", "null", "--early_stopping.mode", "min",
]  # fmt: skip


# Tells a rank that the rendezvous store at MASTER_PORT is hosted for it (torchrun's variable, read by
# app/distributed/rendezvous.py and by torch's env:// rendezvous): rank 0 joins it instead of binding it.
AGENT_STORE = {"TORCHELASTIC_USE_AGENT_STORE": "True"}
_runs = itertools.count()


@contextmanager
def rendezvous_port() -> Iterator[int]:
    """The port of a rendezvous store this process hosts until the block ends, on a port the OS picks:
    start the ranks inside the block with MASTER_PORT = it and AGENT_STORE. Nothing else can take the
    port, and a store of its own per run leaves no keys of an earlier run."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    try:
        yield store.port
    finally:
        del store  # the server stops with its last reference


def run_folder(parent: Path, name: str) -> Path:
    """A new folder for one run's results: ``name`` and a number no other run of this process used."""
    folder = parent / f"{name}_{os.getpid()}_{next(_runs)}"
    folder.mkdir(parents=True)
    return folder


def cli_worker(
    rank: int, world_size: int, port: int, args: list[str], inspect: Inspect | None, out_dir: str,
    environment: dict[str, str] | None = None,
) -> None:
    """One rank of `python -m app <args>` (a new process) joining the store at ``port``
    (``rendezvous_port``): its inspect result, or its error, pickled into out_dir for the test. Shared
    with tests/gpu/gpu_runs.py. ``environment``: the test's environment, for a process forked from the
    fork server, which would otherwise have the server's."""
    if environment is not None:
        os.environ.clear()
        os.environ.update(environment)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), NODE_RANK="0", APP_TRACEBACK="1",
        **AGENT_STORE,
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
    """Runs ``python -m app <args>`` on ``world_size`` processes (``start_cli_ranks``); returns each rank's inspect result."""
    out_dir = run_folder(tmp_path, f"ranks{world_size}")
    with rendezvous_port() as port:
        start_cli_ranks(world_size, port, args, inspect, out_dir)
    results = [pickle.loads((out_dir / f"rank{rank}.pkl").read_bytes()) for rank in range(world_size)]
    for rank, result in enumerate(results):
        assert "error" not in result, f"rank {rank} failed:\n{result['error']}"
    return results


def start_cli_ranks(world_size: int, port: int, args: list[str], inspect: Inspect | None, out_dir: Path) -> None:
    """Runs ``cli_worker`` on ``world_size`` processes forked from the fork server (see above) until all end."""
    mp.start_processes(
        cli_worker, args=(world_size, port, args, inspect, str(out_dir), dict(os.environ)), nprocs=world_size,
        start_method="forkserver",
    )
