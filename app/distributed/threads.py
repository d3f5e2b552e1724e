"""How many intra-op threads each worker process gives torch.

Left alone, every worker starts one intra-op thread per core of the machine, so N processes on a
node oversubscribe its cores N times (measured: 0.60-0.70x of TorchRec's trainer on 2 cores with
2 processes). torchrun avoids that by exporting ``OMP_NUM_THREADS=1``; Lightning's own launcher
divides the cores only in the process that launches the others, and not at all under torchrun,
SLURM or any launcher that starts the workers itself. So the strategy settles it in every worker:

1. ``num_threads_per_process`` (a strategy setting), if given;
2. else ``OMP_NUM_THREADS``, if the user (or torchrun) exported it;
3. else the worker's share of the cores it may run on: cores // processes on this node (at least 1).
"""

from __future__ import annotations

import os

import torch
from lightning.fabric.utilities.data import _num_cpus_available


def resolve_num_threads(
    num_processes_on_node: int, setting: int | None, omp_num_threads: str | None
) -> tuple[int, str]:
    """The thread count and where it came from (for the log), by the precedence in the module docstring."""
    if setting is not None:
        if setting < 1:
            raise ValueError(f"strategy.num_threads_per_process = {setting} must be a positive integer")
        return setting, "strategy.num_threads_per_process"
    if omp_num_threads:
        try:
            value = int(omp_num_threads)
        except ValueError:
            raise ValueError(f"OMP_NUM_THREADS = {omp_num_threads!r} must be a positive integer") from None
        if value < 1:
            raise ValueError(f"OMP_NUM_THREADS = {omp_num_threads!r} must be a positive integer")
        return value, "OMP_NUM_THREADS"
    cores = _num_cpus_available()
    share = max(1, cores // max(1, num_processes_on_node))
    return share, f"{cores} cores // {num_processes_on_node} processes on this node"


def set_worker_threads(num_processes_on_node: int, setting: int | None, omp_num_threads: str | None) -> str:
    """Applies the thread count to this process and returns the line that says why (to be logged once).

    ``omp_num_threads`` is ``OMP_NUM_THREADS`` as the user launched the job: read it before Lightning's
    launcher exports its own value. The value is exported again so that processes this one starts
    (data loader workers) inherit it.
    """
    num_threads, source = resolve_num_threads(num_processes_on_node, setting, omp_num_threads)
    torch.set_num_threads(num_threads)
    os.environ["OMP_NUM_THREADS"] = str(num_threads)
    return f"torch intra-op threads per process: {num_threads} (from {source})"
