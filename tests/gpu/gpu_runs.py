"""Runs of the real CLI for tests/gpu: ``python -m app <subcommand>`` on N spawned processes (one per
GPU, or CPU processes with gloo for the checkpoints that cross devices), each rank's trained objects
read back by an inspect function, and a deadline so that a hung collective fails the test instead of
holding the machine.

Like tests/multiprocess.py (the CPU suite's runner), plus the deadline: ``torch.multiprocessing``'s
``join(timeout)`` gives it without a plugin (pytest-timeout is not installed).
"""

from __future__ import annotations

import pickle
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from tests.multiprocess import cli_worker, rendezvous_port, run_folder

Inspect = Callable[[Any], dict[str, Any]]
# One run of the tiny model is start-up (imports, CUDA context, planning) plus a few seconds of
# steps; 300 s is ten times what it should take, and the strategy's own collective timeout (300 s).
RUN_TIMEOUT_S = 300.0
GPU = ["--trainer.accelerator", "gpu"]  # Lightning's name for CUDA and ROCm alike


def run_app(
    world_size: int, args: list[str], tmp_path: Path, inspect: Inspect | None = None, timeout_s: float = RUN_TIMEOUT_S
) -> list[dict]:
    """Runs ``python -m app <args>`` on ``world_size`` spawned processes; returns each rank's inspect
    result, with the run's wall time in ``wall_s``. A rank's error or the deadline fails the test."""
    out_dir = run_folder(tmp_path, f"ranks{world_size}")
    started = time.perf_counter()
    with rendezvous_port() as port:
        context = mp.start_processes(
            cli_worker, args=(world_size, port, args, inspect, str(out_dir)), nprocs=world_size,
            start_method="spawn", join=False,
        )  # fmt: skip
        deadline = started + timeout_s
        while not context.join(timeout=max(0.0, deadline - time.perf_counter())):
            if time.perf_counter() >= deadline:
                for process in context.processes:
                    process.kill()
                pytest.fail(f"python -m app {args[0]} on {world_size} process(es) did not end within {timeout_s:.0f} s")
    wall_s = time.perf_counter() - started
    results = [pickle.loads((out_dir / f"rank{rank}.pkl").read_bytes()) for rank in range(world_size)]
    for rank, result in enumerate(results):
        assert "error" not in result, f"rank {rank} failed:\n{result['error']}"
        result["wall_s"] = wall_s
    return results


def trained_state(cli) -> dict[str, Any]:
    """What a rank holds after its subcommand: where the model ran, the backend, where its tables
    live, the training probe's steps and validations (fit), whether the training loader pins its
    batches (fit), the dense optimizers' implementation, and the probabilities the model gives the
    whole validation file (computed on the model's device)."""
    import torch.distributed as dist
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    from app.data.batches import make_batch
    from app.data.tsv import read_tsv

    module = cli.trainer.lightning_module
    device = module.device
    table_devices = set()
    for key, value in module.state_dict().items():
        if ".embedding_bags." in key:
            tensors = [s.tensor for s in value.local_shards()] if isinstance(value, ShardedTensor) else [value]
            table_devices |= {t.device.type for t in tensors}
    result: dict[str, Any] = {
        "global_step": cli.trainer.global_step,
        "device": str(device),
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "table_devices": sorted(table_devices),
        "root": str(cli.trainer.default_root_dir),
        "dense_optimizers": _dense_optimizers(cli.trainer.optimizers),
        "callback_metrics": {k: float(v) for k, v in cli.trainer.callback_metrics.items()},
    }
    probes = [c for c in cli.trainer.callbacks if type(c).__name__ == "TrainingProbe"]
    if probes:
        result.update(steps=probes[0].steps, validations=probes[0].validations)
    if cli.subcommand == "fit":
        loader = cli.datamodule.train_dataloader()
        result["loader_pins"] = bool(loader.pin_memory)
        result["batch_pinned"] = bool(next(iter(loader)).dense_features.is_pinned())
    table_sizes = cli.datamodule.table_sizes
    arrays = read_tsv(cli.datamodule.specs["val"], table_sizes)
    rows = np.arange(len(arrays))
    batch = make_batch(arrays.take(rows), rows).to(device)
    module.eval()
    with torch.no_grad():
        result["probabilities"] = torch.sigmoid(module(batch)).float().cpu().numpy()
    return result


def _dense_optimizers(optimizers: list[Any]) -> list[dict[str, Any]]:
    """Each torch optimizer found inside the trainer's (TorchRec's combined and keyed wrappers
    included): its class and whether it runs torch's fused kernel. Best effort: the wrappers' attribute
    names (``optimizers``, ``_optimizer``) are TorchRec's as of 1.6-1.8."""
    found: list[dict[str, Any]] = []

    def visit(obj: Any, depth: int) -> None:
        if depth > 4 or obj is None:
            return
        if isinstance(obj, torch.optim.Optimizer) and type(obj).__module__.startswith("torch.optim"):
            found.append({"class": type(obj).__name__, "fused": bool(obj.defaults.get("fused"))})
            return
        for child in getattr(obj, "optimizers", None) or []:
            visit(child[1] if isinstance(child, tuple) else child, depth + 1)
        visit(getattr(obj, "_optimizer", None), depth + 1)

    for optimizer in optimizers:
        visit(optimizer, 0)
    return found


def losses(run: dict[str, Any]) -> np.ndarray:
    """The training losses of a run's steps, in order."""
    return np.array([step[2] for step in run["steps"]])


def max_abs_difference(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))))


def with_settings(args: list[str], **settings: str) -> list[str]:
    """``args`` with each ``--key value`` set (``trainer__max_steps="10"`` -> ``--trainer.max_steps 10``),
    replacing the value where the key is already given."""
    args = list(args)
    for name, value in settings.items():
        key = "--" + name.replace("__", ".")
        if key in args:
            args[args.index(key) + 1] = value
        else:
            args += [key, value]
    return args


def plan_report(run: dict[str, Any]) -> dict[str, Any]:
    """The run's sharding_plan.json (app/distributed/plan_report.py), written by rank 0 at start-up."""
    import json

    return json.loads(Path(run["root"], "sharding_plan.json").read_text())


def plan_shards(run: dict[str, Any]) -> list[dict[str, Any]]:
    """Every shard of the run's plan with the planner's estimates: table, sharding_type, compute_kernel, rank, ..."""
    return [shard for rank in plan_report(run)["ranks"] for shard in rank["shards"]]
