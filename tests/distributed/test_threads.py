"""Each worker gives torch its share of the cores, unless OMP_NUM_THREADS or the strategy setting says otherwise."""

from __future__ import annotations

import pytest
import torch
from lightning.fabric.utilities.data import _num_cpus_available

from app.distributed.threads import resolve_num_threads
from tests.multiprocess import run_on_ranks
from tests.distributed.test_sharding import fit_args


def threads_seen(cli) -> dict:
    return {"threads": torch.get_num_threads()}


def one_step_args(sample, root) -> list[str]:
    return fit_args(sample, root, "table_wise", 64) + ["--trainer.max_steps", "1", "--trainer.limit_val_batches", "0"]


def test_each_worker_gets_its_share_of_the_cores(sample, tmp_path, monkeypatch):
    # Spawned workers inherit the environment: no OMP_NUM_THREADS, as under Lightning's launcher.
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    ranks = run_on_ranks(2, one_step_args(sample, tmp_path), tmp_path, threads_seen)
    assert [r["threads"] for r in ranks] == [max(1, _num_cpus_available() // 2)] * 2


def test_omp_num_threads_wins_over_the_share(sample, tmp_path, monkeypatch):
    # torchrun exports OMP_NUM_THREADS=1; any value the user exports is kept.
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    ranks = run_on_ranks(2, one_step_args(sample, tmp_path), tmp_path, threads_seen)
    assert [r["threads"] for r in ranks] == [3, 3]


def test_precedence_setting_then_environment_then_share():
    assert resolve_num_threads(2, 5, "3") == (5, "strategy.num_threads_per_process")
    assert resolve_num_threads(2, None, "3") == (3, "OMP_NUM_THREADS")
    cores = _num_cpus_available()
    assert resolve_num_threads(4, None, None)[0] == max(1, cores // 4)
    for setting, environment, message in [(0, None, "num_threads_per_process = 0"), (None, "two", "OMP_NUM_THREADS = 'two'")]:
        with pytest.raises(ValueError, match=message):
            resolve_num_threads(2, setting, environment)
