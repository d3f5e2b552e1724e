"""Launches as a cluster sees them, on localhost: every "node" is its own `python -m app` (Lightning's
launcher with NODE_RANK) or torchrun process. A node that never joins, a wrong master address, a
launch with fewer processes than the config's devices x nodes, a rank that dies or freezes mid-run:
every started rank must end within the configured timeout with a message. Each process runs under a
hard time limit, so that a regression fails the test instead of hanging the suite.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning.fabric.plugins.environments import TorchElasticEnvironment

from app.distributed.launch import check_launch
from multiprocess import DEMO_BEFORE_QUALITY_SETTINGS, free_port

HARD_LIMIT_S = 150  # far above start-up (~10-30 s on a busy 2-core machine) + the timeouts below
TESTS = Path(__file__).resolve().parent


def app_args(sample: dict[str, Path], root: Path, *extra: str) -> list[str]:
    return [
        "fit", "--config", "configs/demo.yaml", *DEMO_BEFORE_QUALITY_SETTINGS,
        "--data.train", str(sample["train"]), "--data.val", str(sample["val"]),
        "--data.test", "null", "--data.predict", "null",
        "--data.batch_size", "64", "--data.num_embeddings_per_feature", "500",
        "--model.embedding_dim", "8", "--model.dense_arch_layer_sizes", "[16, 8]", "--model.over_arch_layer_sizes", "[16, 1]",
        "--trainer.max_epochs", "1", "--trainer.callbacks", "[]", "--trainer.enable_checkpointing", "false",
        "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(root),
        "--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.init_args.save_dir", str(root),
        "--trainer.logger.init_args.name", "logs", *extra,
    ]  # fmt: skip


def start(command: list[str], log: Path, **env: str) -> subprocess.Popen:
    """Starts a process with its output in ``log``; PYTHONPATH reaches the test-only callbacks."""
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path.cwd()), str(TESTS)]), **env}
    full_env.pop("APP_TRACEBACK", None)
    return subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=full_env, cwd=Path.cwd())


def node(args: list[str], log: Path, node_rank: int, port: int) -> subprocess.Popen:
    """One node of Lightning's own launcher: MASTER_ADDR, MASTER_PORT and NODE_RANK, as in the README."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NODE_RANK": str(node_rank)}
    return start([sys.executable, "-m", "app", *args], log, **env)


def finish(process: subprocess.Popen, log: Path) -> tuple[int, str]:
    """Waits at most HARD_LIMIT_S; a process still running then is killed and fails the test."""
    try:
        returncode = process.wait(timeout=HARD_LIMIT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        pytest.fail(f"still running after {HARD_LIMIT_S} s (a hang):\n{log.read_text()[-3000:]}")
    return returncode, log.read_text()


def test_a_node_that_never_joins_and_a_wrong_master_address_end_within_the_rendezvous_timeout(sample, tmp_path):
    args = app_args(sample, tmp_path, "--trainer.devices", "1", "--trainer.num_nodes", "2",
                    "--trainer.strategy.rendezvous_timeout_s", "10")  # fmt: skip
    alone_port, nobody_port = free_port(), free_port()
    # Node 0 started, node 1 never is; and a node 1 pointed at an address where no node 0 listens.
    alone = node(args, tmp_path / "alone.log", node_rank=0, port=alone_port)
    lost = node(args, tmp_path / "lost.log", node_rank=1, port=nobody_port)
    alone_rc, alone_log = finish(alone, tmp_path / "alone.log")
    lost_rc, lost_log = finish(lost, tmp_path / "lost.log")

    assert alone_rc == 2, alone_log[-3000:]
    assert (
        f"error: waited 10 s for 2 ranks at 127.0.0.1:{alone_port}; 1 joined, missing rank(s) 1 of node(s) 1: "
        "is node 1 started (NODE_RANK=1)" in alone_log
    ), alone_log[-3000:]
    assert lost_rc == 2, lost_log[-3000:]
    assert (
        f"error: rank 1 of 2 waited 10 s to reach the rendezvous at 127.0.0.1:{nobody_port} and got no answer: "
        "is node 0 started? check MASTER_ADDR and MASTER_PORT" in lost_log
    ), lost_log[-3000:]
    assert "Traceback" not in alone_log + lost_log


SLURM_ONE_TASK = {"SLURM_NTASKS": "1", "SLURM_NNODES": "1", "SLURM_JOB_NAME": "dlrm", "SLURM_JOB_ID": "1",
                  "SLURM_NODELIST": "127.0.0.1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}  # fmt: skip


def test_an_srun_with_fewer_tasks_than_devices_x_nodes_is_refused_before_training(sample, tmp_path):
    process = start([sys.executable, "-m", "app", *app_args(sample, tmp_path, "--trainer.devices", "2")],
                    tmp_path / "log", **SLURM_ONE_TASK)  # fmt: skip
    returncode, log = finish(process, tmp_path / "log")
    assert returncode == 2, log[-3000:]
    assert (
        "error: SLURM (srun) started 1 processes, but trainer.devices x trainer.num_nodes = 2 x 1 = 2: "
        "launch 2 processes (2 per node" in log
    ), log[-3000:]
    assert "Traceback" not in log


@pytest.mark.parametrize("job_name", ["interactive", "bash"])
def test_srun_tasks_of_a_job_name_that_turns_slurm_detection_off_are_refused(job_name, sample, tmp_path):
    # Task 0 of 2 that srun started for a job Lightning does not see as SLURM's: without the check it
    # would start a second process of its own, and so would task 1.
    tasks = {**SLURM_ONE_TASK, "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_JOB_NAME": job_name}
    process = start([sys.executable, "-m", "app", *app_args(sample, tmp_path, "--trainer.devices", "2")],
                    tmp_path / "log", **tasks)  # fmt: skip
    returncode, log = finish(process, tmp_path / "log")
    assert returncode == 2, log[-3000:]
    assert f"error: srun started 2 tasks of a job named '{job_name}', a name for which Lightning does not detect SLURM" in log
    assert "Traceback" not in log


def test_torchrun_with_another_world_size_than_devices_x_nodes_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match=r"^TorchElasticEnvironment started 3 processes, but trainer.devices x "
                                         r"trainer.num_nodes = 2 x 2 = 4"):  # fmt: skip
        check_launch(TorchElasticEnvironment(), devices=2, num_nodes=2)
    check_launch(TorchElasticEnvironment(), devices=3, num_nodes=1)  # matches: no error


def test_a_rank_that_dies_or_freezes_mid_run_ends_the_other_within_the_timeout(sample, tmp_path):
    """Two nodes of one process each; rank 1 is SIGKILLed (its sockets close) in one job and SIGSTOPped
    (a frozen node: sockets open, silent) in the other, after its third batch."""
    jobs = {}
    for signal_name in ("SIGKILL", "SIGSTOP"):
        args = app_args(sample, tmp_path / signal_name, "--trainer.devices", "1", "--trainer.num_nodes", "2",
                        "--trainer.strategy.timeout_s", "10", "--trainer.callbacks+=cluster_callbacks.StopRank",
                        "--trainer.callbacks.signal_name", signal_name)  # fmt: skip
        port = free_port()
        logs = [tmp_path / f"{signal_name}_node{n}.log" for n in (0, 1)]
        jobs[signal_name] = [(node(args, log, node_rank=n, port=port), log) for n, log in enumerate(logs)]
    try:
        for signal_name, ((node0, log0), (node1, _)) in jobs.items():
            returncode, log = finish(node0, log0)
            assert returncode != 0, log[-3000:]
            assert "another rank died or stalled longer than trainer.strategy.init_args.timeout_s" in log, log[-3000:]
            if signal_name == "SIGSTOP":
                # No peer error can arrive from a frozen rank: only the process-group timeout ends rank 0.
                assert "timeout" in log.lower() and node1.poll() is None, log[-3000:]
    finally:
        for processes in jobs.values():
            for process, _ in processes:
                if process.poll() is None:
                    process.kill()  # the frozen rank: SIGKILL ends a stopped process too
                    process.wait()


def _final_metrics(root: Path) -> dict[str, float]:
    (path,) = root.glob("logs/version_*/metrics.csv")
    rows = list(csv.DictReader(path.open()))
    val = [r for r in rows if r.get("val/auc")][-1]
    train = [r for r in rows if r.get("train/loss")][-1]
    return {key: float(row[key]) for row, key in ((val, "val/auc"), (val, "val/logloss"), (train, "train/loss"))}


def test_two_torchrun_nodes_end_with_the_metrics_of_one_node_and_a_slow_rank_is_reported(sample, tmp_path):
    """Rank 1 of the two-node run sleeps 0.2 s before each step (a test-only callback): the same
    metrics (sleeping changes no number), and the slow-rank warning there and only there."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--master_addr", "127.0.0.1", "--rdzv-conf", "timeout=60"]
    two_nodes, one_node = tmp_path / "two_nodes", tmp_path / "one_node"
    health = ["--rank_health.every_n_steps", "4"]
    slow = ["--trainer.callbacks+=cluster_callbacks.SlowRank", "--trainer.callbacks.delay_s", "0.2"]
    port = free_port()
    nodes = [
        start([*torchrun, "--nnodes", "2", "--nproc_per_node", "1", "--node_rank", str(n), "--master_port", str(port),
               "-m", "app", *app_args(sample, two_nodes, "--trainer.devices", "1", "--trainer.num_nodes", "2", *health, *slow)],
              tmp_path / f"node{n}.log")
        for n in (0, 1)
    ]  # fmt: skip
    logs = [finish(process, tmp_path / f"node{n}.log") for n, process in enumerate(nodes)]
    for returncode, log in logs:
        assert returncode == 0, log[-3000:]
    single = start([*torchrun, "--nnodes", "1", "--nproc_per_node", "2", "--master_port", str(free_port()),
                    "-m", "app", *app_args(sample, one_node, "--trainer.devices", "2", *health)], tmp_path / "single.log")  # fmt: skip
    returncode, single_log = finish(single, tmp_path / "single.log")
    assert returncode == 0, single_log[-3000:]

    assert _final_metrics(two_nodes) == _final_metrics(one_node)
    assert _final_metrics(one_node)["val/auc"] != 0.5  # a real evaluation, not an empty one
    assert "slow rank: rank 1 spends" in logs[0][1], logs[0][1][-3000:]
    assert "slow rank" not in single_log
    (path,) = two_nodes.glob("logs/version_*/metrics.csv")
    gaps = [(float(r["health/between_steps_ms/rank0"]), float(r["health/between_steps_ms/rank1"]))
            for r in csv.DictReader(path.open()) if r.get("health/between_steps_ms/rank1")]  # fmt: skip
    assert len(gaps) == 3 and all(slow_ms >= 200 > fast_ms for fast_ms, slow_ms in gaps), gaps
