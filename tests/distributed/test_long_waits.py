"""Waits longer than the collective timeout, on 2 CPU processes (gloo): the planner plans for the least
free HBM of any rank, barriers wait on their own gloo group with their own timeout, and a rank that dies
still ends such a wait at once."""

from __future__ import annotations

import dataclasses
import os
import pickle
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from app.distributed.rendezvous import join_process_group, long_wait_group, wait_for_every_rank
from app.distributed.hbm_budget import least_hbm_over_ranks
from app.distributed.topology import GIB, HBM_FREE_AT_PLANNING, PRESETS
from tests.multiprocess import AGENT_STORE, rendezvous_port

COLLECTIVE_TIMEOUT_S = 30.0
BARRIER_TIMEOUT_S = 3600.0


def _rank(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(AGENT_STORE)  # the test hosts the rendezvous store at port
    join_process_group(
        "gloo", address="127.0.0.1", port=port, rank=rank, world_size=2, processes_per_node=2,
        rendezvous_timeout_s=60, timeout_s=COLLECTIVE_TIMEOUT_S,
    )  # fmt: skip
    free = dataclasses.replace(PRESETS["h100"], hbm_cap_bytes=(70, 60)[rank] * GIB, hbm_cap_source=HBM_FREE_AT_PLANNING)
    preset = dataclasses.replace(PRESETS["h100"], hbm_cap_bytes=(70, 60)[rank] * GIB)
    result = {
        "least": least_hbm_over_ranks(free, dist.group.WORLD),
        "preset": least_hbm_over_ranks(preset, dist.group.WORLD),
    }
    wait_for_every_rank(BARRIER_TIMEOUT_S)
    result["barrier_timeout"] = long_wait_group(BARRIER_TIMEOUT_S)._get_backend(torch.device("cpu")).options._timeout
    result["default_timeout"] = dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout
    if rank == 1:
        Path(out_dir, "rank1.pkl").write_bytes(pickle.dumps(result))
        os._exit(0)  # dies without coming to the next barrier
    try:
        wait_for_every_rank(BARRIER_TIMEOUT_S)
        result["after_death"] = "returned"
    except RuntimeError as error:
        result["after_death"] = str(error)
    Path(out_dir, "rank0.pkl").write_bytes(pickle.dumps(result))
    os._exit(0)


def test_plans_for_the_least_free_hbm_and_long_waits_have_their_own_timeout_yet_see_a_dead_rank(tmp_path):
    with rendezvous_port() as port:
        context = mp.start_processes(_rank, args=(port, str(tmp_path)), nprocs=2, start_method="forkserver", join=False)
        # Fails fast if the wait after rank 1's death hangs (it must not wait for BARRIER_TIMEOUT_S).
        for _ in range(12):
            if context.join(timeout=10):
                break
        else:
            for process in context.processes:
                process.kill()
            raise AssertionError("rank 0 still waits at the barrier 2 minutes after rank 1 died")
    ranks = [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in range(2)]
    for result in ranks:
        assert result["least"].hbm_cap_bytes == 60 * GIB  # rank 1's, on both ranks
        assert result["least"].hbm_cap_source == f"{HBM_FREE_AT_PLANNING} (least over ranks)"
        assert result["preset"].hbm_cap_bytes in (60 * GIB, 70 * GIB)  # a preset's figure is left as it is
        assert result["barrier_timeout"] == timedelta(seconds=BARRIER_TIMEOUT_S)
        assert result["default_timeout"] == timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    assert ranks[0]["preset"].hbm_cap_bytes == 70 * GIB and ranks[1]["preset"].hbm_cap_bytes == 60 * GIB
    # Named at once, not after BARRIER_TIMEOUT_S (gloo saw rank 1's connection close).
    assert "1 failed to pass monitoredBarrier" in ranks[0]["after_death"]
