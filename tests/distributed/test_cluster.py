"""Launches as a cluster sees them, on localhost: every "node" is its own `python -m app` (Lightning's
launcher with NODE_RANK) or torchrun process. A node that never joins, a wrong master address, a
launch with fewer processes than the config's devices x nodes, a rank that dies or freezes mid-run:
every started rank must end within the configured timeout with a message. Each process runs under a
hard time limit, so that a regression fails the test instead of hanging the suite.

Node 0 hosts the rendezvous on a port that was free a moment before it binds it; another process can
take it in between (an outgoing connection's port on a busy machine): node 0 then says so, and
``launch`` starts the nodes again on another port instead of failing the test.
"""

from __future__ import annotations

import csv
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import pytest

import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment

from app.distributed.launch import check_launch, slurm_main_port
from app.distributed.rendezvous import RendezvousError, join_process_group
from tests.multiprocess import DEMO_BEFORE_QUALITY_SETTINGS

HARD_LIMIT_S = 150  # far above start-up (~10-30 s on a busy 2-core machine) + the timeouts below
REPO = Path(__file__).resolve().parents[2]  # on PYTHONPATH: the test-only callbacks are tests.<group>.<module>.<Class>
# Node 0's message (app/distributed/rendezvous.py) or torchrun's agent's, when its port was taken.
PORT_TAKEN = ("is already in use on this node", "EADDRINUSE")
Nodes = list[tuple[subprocess.Popen, Path]]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def held_port() -> Iterator[int]:
    """A port bound (not listening) by this process for the block: nothing else can bind it, and a
    connection to it is refused, as to a node 0 that never started."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


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
    full_env = {**os.environ, "PYTHONPATH": str(REPO)}
    for name in ("APP_TRACEBACK", "MASTER_PORT"):
        full_env.pop(name, None)
    full_env.update(env)
    return subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=full_env, cwd=Path.cwd())


def node(args: list[str], log: Path, node_rank: int, port: int) -> subprocess.Popen:
    """One node of Lightning's own launcher: MASTER_ADDR, MASTER_PORT and NODE_RANK, as in the README."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NODE_RANK": str(node_rank)}
    return start([sys.executable, "-m", "app", *args], log, **env)


def finish(process: subprocess.Popen, log: Path, limit_s: float = HARD_LIMIT_S) -> tuple[int, str]:
    """Waits at most ``limit_s``; a process still running then is killed and fails the test."""
    try:
        returncode = process.wait(timeout=max(limit_s, 0))
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        pytest.fail(f"still running after {limit_s:.0f} s (a hang):\n{log.read_text()[-3000:]}")
    return returncode, log.read_text()


def launch(
    start_nodes: Callable[[int], Nodes], limit_s: float = HARD_LIMIT_S, started: Nodes | None = None
) -> tuple[tuple[int, str], Nodes]:
    """Starts the nodes on a free port (node 0 first in the list, hosting the rendezvous), or takes those
    ``started`` so, and waits for node 0: its (returncode, log), and the nodes. Started again on another
    port, the others killed, when node 0 found the port taken; three times taken fails the test."""
    for _ in range(3):
        nodes = started or start_nodes(_free_port())
        started = None
        node0 = finish(*nodes[0], limit_s)
        if not any(text in node0[1] for text in PORT_TAKEN):
            return node0, nodes
        for process, _ in nodes[1:]:
            process.kill()
            process.wait()
    pytest.fail(f"node 0 found its port taken three times:\n{node0[1][-3000:]}")


# Below the rendezvous_timeout_s default (120 s): a run that ignored the test's 5 s would still be waiting.
RENDEZVOUS_LIMIT_S = 90


def test_a_node_that_never_joins_and_a_wrong_master_address_end_within_the_rendezvous_timeout(sample, tmp_path):
    args = app_args(sample, tmp_path, "--trainer.devices", "1", "--trainer.num_nodes", "2",
                    "--trainer.strategy.rendezvous_timeout_s", "5")  # fmt: skip
    deadline = time.monotonic() + RENDEZVOUS_LIMIT_S  # one bound for both processes, from their start
    with held_port() as nobody_port:
        # A node 1 pointed at an address where no node 0 listens; node 0 started, node 1 never is.
        lost = node(args, tmp_path / "lost.log", node_rank=1, port=nobody_port)

        def alone(port: int) -> Nodes:
            return [(node(args, tmp_path / f"alone{port}.log", node_rank=0, port=port), tmp_path / f"alone{port}.log")]

        (alone_rc, alone_log), _ = launch(alone, limit_s=deadline - time.monotonic())
        lost_rc, lost_log = finish(lost, tmp_path / "lost.log", limit_s=deadline - time.monotonic())

    assert alone_rc == 2, alone_log[-3000:]
    assert (
        "error: waited 5 s for 2 ranks at 127.0.0.1:" in alone_log
        and "; 1 joined, missing rank(s) 1 of node(s) 1: is node 1 started (NODE_RANK=1)" in alone_log
    ), alone_log[-3000:]
    assert lost_rc == 2, lost_log[-3000:]
    assert (
        f"error: rank 1 of 2 waited 5 s to reach the rendezvous at 127.0.0.1:{nobody_port} and got no answer: "
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


def test_a_gloo_interface_this_node_lacks_is_refused_before_training(sample, tmp_path):
    process = start([sys.executable, "-m", "app", *app_args(sample, tmp_path, "--trainer.devices", "1")],
                    tmp_path / "log", GLOO_SOCKET_IFNAME="nosuch0")  # fmt: skip
    returncode, log = finish(process, tmp_path / "log")
    assert returncode == 2, log[-3000:]
    assert "error: GLOO_SOCKET_IFNAME=nosuch0: no interface nosuch0: this node (" in log, log[-3000:]
    assert "Traceback" not in log


def test_torchrun_with_another_world_size_than_devices_x_nodes_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match=r"^TorchElasticEnvironment started 3 processes, but trainer.devices x "
                                         r"trainer.num_nodes = 2 x 2 = 4"):  # fmt: skip
        check_launch(TorchElasticEnvironment(), devices=2, num_nodes=2)
    check_launch(TorchElasticEnvironment(), devices=3, num_nodes=1)  # matches: no error


def _as_slurm_task(monkeypatch, job_id: str, **variables: str) -> None:
    for name, value in {**SLURM_ONE_TASK, "SLURM_JOB_ID": job_id, "SLURM_STEP_ID": "0", **variables}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("MASTER_PORT", raising=False)


def test_slurm_jobs_whose_ids_end_alike_get_ports_of_their_own(monkeypatch):
    # Lightning's rule, 15000 + the job id's last four digits: jobs 1234 and 51234 on one node collide.
    for job_id in ("1234", "51234"):
        _as_slurm_task(monkeypatch, job_id)
        assert SLURMEnvironment().main_port == 16234
    ports = {}
    for job_id, step_id in [("1234", "0"), ("51234", "0"), ("1234", "1")]:
        _as_slurm_task(monkeypatch, job_id, SLURM_STEP_ID=step_id)
        check_launch(SLURMEnvironment(), devices=1, num_nodes=1)  # exports MASTER_PORT; Lightning reads it
        ports[job_id, step_id] = SLURMEnvironment().main_port
    assert ports == {("1234", "0"): 16234, ("51234", "0"): 15000 + 51234 % 17768, ("1234", "1"): 16234 + 1009}
    _as_slurm_task(monkeypatch, "1234")
    monkeypatch.setenv("MASTER_PORT", "29999")  # the user's choice is kept
    check_launch(SLURMEnvironment(), devices=1, num_nodes=1)
    assert SLURMEnvironment().main_port == 29999


@contextmanager
def held_slurm_port() -> Iterator[tuple[str, int]]:
    """A SLURM job id whose port (launch.slurm_main_port) this process holds bound for the block."""
    for job_id in range(4242, 4242 + 20 * 1777, 1777):  # 20 ports spread over the range
        port = slurm_main_port(job_id, step_id=0)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use here already: try another
            yield str(job_id), port
            return
    pytest.fail("found no free port in the SLURM range")


def test_a_slurm_jobs_port_in_use_on_its_node_is_named_with_what_to_do(sample, tmp_path):
    """Task 0 of a 2-task srun job whose port another process holds: one line, no hang, no traceback."""
    with held_slurm_port() as (job_id, port):
        tasks = {**SLURM_ONE_TASK, "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_STEP_NUM_TASKS": "2",
                 "SLURM_JOB_ID": job_id, "SLURM_STEP_ID": "0"}  # fmt: skip
        process = start([sys.executable, "-m", "app", *app_args(sample, tmp_path, "--trainer.devices", "2")],
                        tmp_path / "log", **tasks)  # fmt: skip
        returncode, log = finish(process, tmp_path / "log")
    assert returncode == 2, log[-3000:]
    assert (
        f"error: rank 0 could not host the rendezvous at 127.0.0.1:{port}: port {port} is already in use on this "
        "node by another program; this job stops; export MASTER_PORT=<a free port, 1024-32767> for every task" in log
    ), log[-3000:]
    assert "Traceback" not in log


def test_a_rank_that_reaches_another_jobs_rendezvous_is_told_at_once(monkeypatch):
    """Job 51234's rank 1 on the port of job 1234's rendezvous (rank 0 of 51234 could not host it): an error
    naming both jobs, when job 1234's name is there on arrival and when it comes while rank 1 waits;
    job 1234's count of joined ranks is never touched."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    where = f"127.0.0.1:{store.port}"
    join = dict(backend="gloo", address="127.0.0.1", port=store.port, rank=1, world_size=2, processes_per_node=1,
                rendezvous_timeout_s=60, timeout_s=60)  # fmt: skip
    message = (
        f"^rank 1 of SLURM job 51234 found the rendezvous at {re.escape(where)} held by SLURM job 1234: "
        "two jobs were given the same port on one node; export MASTER_PORT"
    )
    _as_slurm_task(monkeypatch, "51234")
    errors: list[BaseException] = []

    def rank1_of_51234() -> None:
        try:
            join_process_group(**join)
        except BaseException as error:  # noqa: BLE001 - handed to the test
            errors.append(error)

    waiting = threading.Thread(target=rank1_of_51234, daemon=True)
    waiting.start()
    store.wait(["app_rendezvous/SLURM job 51234/0/rank1"], timedelta(seconds=60))  # it waits now
    store.set("app_rendezvous/job", "SLURM job 1234")  # what job 1234's rank 0 writes
    waiting.join(timeout=60)
    assert not waiting.is_alive() and len(errors) == 1 and isinstance(errors[0], RendezvousError), errors
    assert re.match(message, str(errors[0])), errors[0]
    with pytest.raises(RendezvousError, match=message):  # job 1234's name already there
        join_process_group(**join)
    assert not store.check(["app_rendezvous/SLURM job 1234/0/joined"])
    assert not dist.is_initialized()


def test_a_rank_that_dies_or_freezes_mid_run_ends_the_other_within_the_timeout(sample, tmp_path):
    """Rank 1 is SIGKILLed (its sockets close) after its third batch in a job of one node of two ranks
    (Lightning's launcher: rank 0, its parent, names it), and SIGSTOPped (a frozen node: sockets open,
    silent) in a job of two nodes of one process each. The two jobs run at once."""

    def job(signal_name: str) -> Callable[[int], Nodes]:
        nodes = 2 if signal_name == "SIGSTOP" else 1
        args = app_args(sample, tmp_path / signal_name, "--trainer.devices", str(3 - nodes), "--trainer.num_nodes",
                        str(nodes), "--trainer.strategy.timeout_s", "10",
                        "--trainer.callbacks+=tests.distributed.cluster_callbacks.StopRank",
                        "--trainer.callbacks.signal_name", signal_name)  # fmt: skip

        def start_nodes(port: int) -> Nodes:
            logs = [tmp_path / f"{signal_name}_{port}_node{n}.log" for n in range(nodes)]
            return [(node(args, log, node_rank=n, port=port), log) for n, log in enumerate(logs)]

        return start_nodes

    jobs = {signal_name: job(signal_name) for signal_name in ("SIGKILL", "SIGSTOP")}
    started = {signal_name: start_nodes(_free_port()) for signal_name, start_nodes in jobs.items()}
    try:
        for signal_name, start_nodes in jobs.items():
            (returncode, log), started[signal_name] = launch(start_nodes, started=started[signal_name])
            assert returncode != 0, log[-3000:]
            assert "another rank died or stalled longer than trainer.strategy.init_args.timeout_s" in log, log[-3000:]
            if signal_name == "SIGKILL":
                assert re.search(r"\nerror: rank 1 \(pid \d+ on .+\) was killed by SIGKILL; the other ranks' errors "
                                 r"follow from it\n", log), log[-3000:]  # fmt: skip
            if signal_name == "SIGSTOP":
                # No peer error can arrive from a frozen rank: only the process-group timeout ends rank 0.
                assert "timeout" in log.lower() and started[signal_name][1][0].poll() is None, log[-3000:]
    finally:
        for nodes in started.values():
            for process, _ in nodes:
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
    """Rank 1 of the two-node run takes 250 ms longer before each step on the clock the slow-rank check
    reads (a test-only callback: a virtual clock, no sleep): the same metrics, exact times between
    steps whatever the machine's load, and the slow-rank warning there and only there."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--master_addr", "127.0.0.1", "--rdzv-conf", "timeout=60"]
    health = ["--rank_health.every_n_steps", "4"]
    slow = ["--trainer.callbacks+=tests.distributed.cluster_callbacks.SlowRank", "--trainer.callbacks.delay_s"]

    def two_nodes(port: int) -> Nodes:
        args = app_args(sample, tmp_path / f"two_nodes{port}", "--trainer.devices", "1", "--trainer.num_nodes", "2",
                        *health, *slow, "0.25")  # fmt: skip
        return [(start([*torchrun, "--nnodes", "2", "--nproc_per_node", "1", "--node_rank", str(n), "--master_port",
                        str(port), "-m", "app", *args], tmp_path / f"node{n}_{port}.log"), tmp_path / f"node{n}_{port}.log")
                for n in (0, 1)]  # fmt: skip

    def one_node(port: int) -> Nodes:
        args = app_args(sample, tmp_path / f"one_node{port}", "--trainer.devices", "2", *health, *slow, "0")
        command = [*torchrun, "--nnodes", "1", "--nproc_per_node", "2", "--master_port", str(port), "-m", "app", *args]
        return [(start(command, tmp_path / f"single{port}.log"), tmp_path / f"single{port}.log")]

    (returncode, node0_log), nodes = launch(two_nodes)
    assert returncode == 0, node0_log[-3000:]
    returncode, node1_log = finish(*nodes[1])
    assert returncode == 0, node1_log[-3000:]
    (returncode, single_log), _ = launch(one_node)
    assert returncode == 0, single_log[-3000:]

    (two_nodes_root,) = tmp_path.glob("two_nodes*/logs")
    (one_node_root,) = tmp_path.glob("one_node*/logs")
    assert _final_metrics(two_nodes_root.parent) == _final_metrics(one_node_root.parent)
    assert _final_metrics(one_node_root.parent)["val/auc"] != 0.5  # a real evaluation, not an empty one
    assert "slow rank: rank 1 spends 250 ms between steps, the median rank 0 ms" in node0_log, node0_log[-3000:]
    assert "slow rank" not in single_log
    (path,) = two_nodes_root.glob("version_*/metrics.csv")
    gaps = [(float(r["health/between_steps_ms/rank0"]), float(r["health/between_steps_ms/rank1"]))
            for r in csv.DictReader(path.open()) if r.get("health/between_steps_ms/rank1")]  # fmt: skip
    # Rank 0's clock never moves; rank 1's moves 250 ms before each step. The first window of 4 steps has
    # 3 gaps, later ones 4 (the gap across a window's boundary counts): each averaged over its own gaps.
    assert gaps == [(0.0, 250.0), (0.0, 250.0), (0.0, 250.0)], gaps
