"""Every rank ends with its job (app/distributed/job_lifetime.py), under Lightning's launcher: a second job
started on a running job's port is refused with one line and leaves no rank behind, without touching the
running job's rendezvous; a running job's ranks end when its launcher is SIGKILLed.

Each launch runs in a session of its own, so that its process group holds the launcher and every rank it
started (an orphan included): "no rank left" is that group holding no living process once the launcher
has ended, polled up to a deadline. Every wait has a deadline, and the group is killed at the end whatever
happened, so that a regression fails the test instead of hanging the suite.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from app.distributed.job_lifetime import (
    JOB_ID_VARIABLE,
    JOB_NAME_VARIABLE,
    LAUNCHER_PID_VARIABLE,
    children_follow_this_process,
    port_holder,
    shared_job_id,
)
from app.distributed.rendezvous import RendezvousError, accepts_connections, join_process_group, job_name
from tests.distributed.test_cluster import app_args

DEADLINE_S = 60.0  # far above a start-up on a busy 2-core machine (~5-15 s)
REPO = Path(__file__).resolve().parents[2]


def _start(args: list[str], log: Path, port: int) -> subprocess.Popen:
    """``python -m app <args>`` under Lightning's launcher on ``port``, in a session of its own."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NODE_RANK": "0"}
    for name in ("APP_TRACEBACK", "LOCAL_RANK", "WORLD_SIZE", LAUNCHER_PID_VARIABLE, JOB_ID_VARIABLE):
        env.pop(name, None)
    command = [sys.executable, "-m", "app", *args]
    return subprocess.Popen(
        command, cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
    )


def _living_processes_of_group(group: int) -> list[int]:
    """The processes of process group ``group`` that have not ended (zombies are ended), from /proc."""
    living = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _, process_group = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue  # ended while being read
        if int(process_group) == group and state not in ("Z", "X"):
            living.append(int(stat.parent.name))
    return living


def _wait_until(condition: Callable[[], bool], what: str, log: Path) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} not within {DEADLINE_S:.0f} s:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)  # polling a condition, with the deadline above


def _end(process: subprocess.Popen, log: Path) -> int:
    try:
        return process.wait(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the launcher still runs after {DEADLINE_S:.0f} s (a hang):\n{log.read_text()[-3000:]}")


def _wait_for_the_group_to_end(launcher: subprocess.Popen, log: Path) -> None:
    """Fails the test unless every process of the launch has ended within the deadline."""
    _wait_until(lambda: not _living_processes_of_group(launcher.pid), "the end of every process of the launch", log)


def _kill_group(launcher: subprocess.Popen) -> None:
    """Whatever a test left of a launch, orphans included."""
    if _living_processes_of_group(launcher.pid):
        os.killpg(launcher.pid, signal.SIGKILL)
    launcher.wait()


def _listens(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


@dataclass
class RunningJob:
    launcher: subprocess.Popen
    port: int
    log: Path
    store: dist.TCPStore  # a client of the job's rendezvous store

    def joined(self) -> int:
        """How many ranks have checked in at the job's rendezvous (app/distributed/rendezvous.py's keys)."""
        owner = self.store.get("app_rendezvous/job").decode()
        return self.store.add(f"app_rendezvous/{owner}/0/joined", 0)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def running_job(sample, tmp_path_factory) -> Iterator[RunningJob]:
    """A job of 2 nodes x 2 ranks whose node 1 never starts: node 0's ranks wait at their rendezvous
    (rank 0 hosts it) until the test ends them; yielded once rank 0 hosts it (rank 1 may still start)."""
    folder = tmp_path_factory.mktemp("running_job")
    # Its rendezvous outlasts the tests however busy the machine (the fixture ends it).
    args = app_args(sample, folder, "--trainer.devices", "2", "--trainer.num_nodes", "2",
                    "--trainer.strategy.rendezvous_timeout_s", "3600")  # fmt: skip
    port, log = _free_port(), folder / "log"
    launcher = _start(args, log, port)
    try:
        _wait_until(lambda: _listens(port) or launcher.poll() is not None, "the rendezvous", log)
        # (another program on the port the moment it was free: rerun)
        assert f"(pid {launcher.pid}: " in port_holder(port), f"{port_holder(port)}\n{log.read_text()[-3000:]}"
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=DEADLINE_S))
        yield RunningJob(launcher, port, log, store)
    finally:
        _kill_group(launcher)


def test_a_second_job_on_a_running_jobs_port_is_refused_and_leaves_no_rank(running_job, sample, tmp_path):
    # Started while the running job's rank 1 may still be starting: the two start-ups share the CPUs.
    second = _start(app_args(sample, tmp_path, "--trainer.devices", "2"), tmp_path / "log", running_job.port)
    try:
        returncode = _end(second, tmp_path / "log")
        _wait_for_the_group_to_end(second, tmp_path / "log")
    finally:
        _kill_group(second)
    log = (tmp_path / "log").read_text()
    port = running_job.port
    assert returncode == 2, log[-3000:]
    (line,) = [line for line in log.splitlines() if "could not host the rendezvous" in line]
    assert line.startswith(
        f"error: rank 0 could not host the rendezvous at 127.0.0.1:{port}: port {port} is already in use on this "
        f"node by another job of this app (pid {running_job.launcher.pid}: "
    ), line
    assert "this job stops; export MASTER_PORT=<a free port" in line and "Traceback" not in log, log[-3000:]
    # The running job's rendezvous counts its own two ranks only (the second job's have all ended), and it waits on.
    _wait_until(lambda: running_job.joined() >= 2, "the running job's rank 1 at its rendezvous", running_job.log)
    assert running_job.joined() == 2
    assert running_job.launcher.poll() is None


def test_the_ranks_of_a_killed_launcher_end_with_it(running_job):
    _wait_until(lambda: running_job.joined() == 2, "both ranks of node 0 at the rendezvous", running_job.log)
    ranks = [pid for pid in _living_processes_of_group(running_job.launcher.pid) if pid != running_job.launcher.pid]
    assert ranks, "the running job shows no rank besides its launcher"
    running_job.launcher.send_signal(signal.SIGKILL)
    running_job.launcher.wait(timeout=DEADLINE_S)
    _wait_for_the_group_to_end(running_job.launcher, running_job.log)


def test_each_launch_draws_its_own_job_id_and_only_its_children_get_the_launchers_pid(monkeypatch):
    for name in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", JOB_ID_VARIABLE):  # JOB_ID_VARIABLE: restored after
        monkeypatch.delenv(name, raising=False)
    names = []
    for _ in range(2):
        with children_follow_this_process(num_nodes=1):
            assert os.environ[LAUNCHER_PID_VARIABLE] == str(os.getpid())
        assert LAUNCHER_PID_VARIABLE not in os.environ
        names.append(job_name())
    assert names[0] != names[1] and all(name.startswith("job ") for name in names), names


def test_the_nodes_of_one_launch_derive_one_job_id_and_two_jobs_on_one_port_differ(monkeypatch):
    """Over several nodes each node's launcher derives the id alone: alike for the same command line, address,
    port and node count, different when any differs; APP_JOB_NAME, the user's name, wins."""
    monkeypatch.delenv(JOB_NAME_VARIABLE, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "node0.example")
    monkeypatch.setenv("MASTER_PORT", "29500")
    command = ["fit", "--config", "configs/demo.yaml", "--trainer.num_nodes", "2"]
    monkeypatch.setattr(sys, "argv", ["/node0/checkout/app/__main__.py", *command])
    node_0 = shared_job_id(num_nodes=2)
    monkeypatch.setattr(sys, "argv", ["/node1/elsewhere/app/__main__.py", *command])  # the program's path aside
    assert shared_job_id(num_nodes=2) == node_0 and node_0.startswith("cmd-")
    assert shared_job_id(num_nodes=3) != node_0
    monkeypatch.setattr(sys, "argv", ["app", *command, "--trainer.max_steps", "9"])
    assert shared_job_id(num_nodes=2) != node_0
    monkeypatch.setattr(sys, "argv", ["app", *command])
    monkeypatch.setenv("MASTER_PORT", "29501")
    assert shared_job_id(num_nodes=2) != node_0
    monkeypatch.setenv(JOB_NAME_VARIABLE, "ctr-nightly")
    assert shared_job_id(num_nodes=2) == "ctr-nightly"
    monkeypatch.delenv(JOB_ID_VARIABLE, raising=False)  # restored after the test
    with children_follow_this_process(num_nodes=2):
        pass
    assert job_name() == "job ctr-nightly"


def test_a_rank_of_a_job_of_several_nodes_is_refused_at_another_jobs_rendezvous(monkeypatch):
    """Node 1's first rank (rank 2 of 2 nodes x 2) of one job at the rendezvous another job's rank 0 hosts
    (a real store holding that job's name, as rank 0 writes it): one line naming the port and both jobs."""
    for name in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(name, raising=False)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store.set("app_rendezvous/job", "job cmd-aaaaaaaaaaaa")
    monkeypatch.setenv(JOB_ID_VARIABLE, "cmd-bbbbbbbbbbbb")
    with pytest.raises(RendezvousError) as refused:
        join_process_group("gloo", address="127.0.0.1", port=store.port, rank=2, world_size=4, processes_per_node=2,
                           rendezvous_timeout_s=60, timeout_s=60)  # fmt: skip
    assert str(refused.value).startswith(
        f"rank 2 of job cmd-bbbbbbbbbbbb found the rendezvous at 127.0.0.1:{store.port} held by job cmd-aaaaaaaaaaaa: "
        "two jobs were given the same MASTER_ADDR and MASTER_PORT; export MASTER_PORT=<a free port"
    ), refused.value
    assert f"export the same {JOB_NAME_VARIABLE}=<a name for the job> on every node" in str(refused.value)
    assert not store.check(["app_rendezvous/job cmd-aaaaaaaaaaaa/0/joined"])  # counted in no job
    assert not dist.is_initialized()


def test_a_rank_whose_launcher_is_gone_stops_with_one_line():
    # Launcher pid 1: the rank's parent is this test, as it is init once the launcher has ended.
    gone = {LAUNCHER_PID_VARIABLE: "1", "LOCAL_RANK": "1"}
    code = "from app.distributed.job_lifetime import follow_launcher; follow_launcher(); print('still running')"
    rank = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **gone}, cwd=REPO, capture_output=True, text=True,
        timeout=DEADLINE_S,
    )  # fmt: skip
    assert rank.returncode == 1 and rank.stdout == "", rank
    assert rank.stderr == "error: rank 1: the launching process 1 has ended; this rank stops with it\n"


def test_the_holder_of_a_port_is_named_with_its_pid_and_command():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        holder = port_holder(sock.getsockname()[1])
    assert holder.startswith(f"another program (pid {os.getpid()}: "), holder


def _rank_1_joining(port: int, rendezvous_timeout_s: float, log: Path) -> subprocess.Popen:
    """A rank 1 of 2 joining the rendezvous at ``port`` (as the strategy does), in a session of its own; a
    RendezvousError printed as the CLI prints it."""
    code = (
        "import sys\n"
        "from app.distributed.rendezvous import RendezvousError, join_process_group\n"
        "try:\n"
        f"    join_process_group('gloo', address='127.0.0.1', port={port}, rank=1, world_size=2, processes_per_node=1,"
        f" rendezvous_timeout_s={rendezvous_timeout_s}, timeout_s=30)\n"
        "except RendezvousError as error:\n"
        "    print(f'error: {error}', file=sys.stderr)\n"
        "    sys.exit(2)\n"
    )
    env = {**os.environ, "NODE_RANK": "1", "RANK": "1"}
    return subprocess.Popen(
        [sys.executable, "-c", code], cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip


def test_a_rank_whose_port_leads_to_another_program_ends_within_the_rendezvous_timeout(tmp_path):
    # Two programs that are not a TCPStore: one that answers in its own protocol (torch's handshake fails and
    # retries until the timeout), and one that accepts and never answers (torch's handshake waits forever: the
    # app's watchdog ends the rank). Both ranks run at once.
    http_port = _free_port()
    http_log = tmp_path / "http.log"
    http = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(http_port), "--bind", "127.0.0.1"], cwd=tmp_path,
        stdout=http_log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    silent = socket.socket()
    try:
        silent.bind(("127.0.0.1", 0))
        silent.listen()  # the kernel accepts the connections; nothing ever reads or answers
        _wait_until(lambda: _listens(http_port) or http.poll() is not None, "http.server listening", http_log)
        logs = {port: tmp_path / f"rank_{port}.log" for port in (http_port, silent.getsockname()[1])}
        ranks = {port: _rank_1_joining(port, 1.0, log) for port, log in logs.items()}
        try:
            codes = {port: _end(rank, logs[port]) for port, rank in ranks.items()}
            for port, rank in ranks.items():
                _wait_for_the_group_to_end(rank, logs[port])  # no process of the rank left
        finally:
            for rank in ranks.values():
                _kill_group(rank)
    finally:
        silent.close()
        _kill_group(http)
    for port, code in codes.items():
        log = logs[port].read_text()
        assert code == 2, log[-3000:]
        (line,) = [line for line in log.splitlines() if line.startswith("error:")]
        assert line == (
            f"error: rank 1 of 2: 127.0.0.1:{port} is not a rendezvous of this app (no TCPStore answered within 1 s; "
            f"another program holds port {port} there): check MASTER_ADDR and MASTER_PORT (they must name node 0's "
            "rendezvous, on every node), or free the port on that node"
        ), log[-3000:]
        assert "Traceback" not in log, log[-3000:]


def test_the_watchdog_tells_a_port_nobody_listens_on_from_one_another_program_holds():
    # On a busy machine torch's timeout for a port with no listener can raise after the watchdog fires: the
    # watchdog's line then depends on whether the port takes a connection (a program) or refuses it (nobody).
    with socket.socket() as bound, socket.socket() as listening:
        bound.bind(("127.0.0.1", 0))  # bound, not listening: refused, as for a node 0 not started yet
        listening.bind(("127.0.0.1", 0))
        listening.listen()  # taken by the kernel, never answered: a program that is not a store
        assert not accepts_connections("127.0.0.1", bound.getsockname()[1])
        assert accepts_connections("127.0.0.1", listening.getsockname()[1])


@pytest.mark.parametrize(
    "first_end, named",
    [
        (signal.SIGKILL, "error: rank 1 (pid {pid} on {host}) was killed by SIGKILL; the other ranks' errors follow "
                         "from it\n"),
        ("exit 1", ""),  # a rank that exits prints its own error
    ],
)  # fmt: skip
def test_only_the_first_rank_to_fail_is_named_not_those_lightnings_observer_kills_after_it(first_end, named, capfd):
    """Three local ranks (real processes) under the launcher's watch: rank 1 fails first, then Lightning's own
    child-process observer SIGKILLs the others, as it does with 3 or more ranks on a node; only rank 1 may be
    named, and only when a signal ended it."""
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver

    from app.distributed.launch import JobLauncher

    wait = "import sys; sys.stdin.read(); sys.exit(1)"  # ends with code 1 once its stdin closes
    ranks = {rank: subprocess.Popen([sys.executable, "-c", wait], stdin=subprocess.PIPE) for rank in (1, 2, 3)}
    standing_in_for_the_launcher = subprocess.Popen([sys.executable, "-c", wait], stdin=subprocess.PIPE)
    launcher = JobLauncher(LightningEnvironment(), num_processes=4, num_nodes=1)
    watch = threading.Thread(target=launcher._name_ranks_a_signal_ends, args=(ranks,), daemon=True)
    try:
        watch.start()
        if first_end == "exit 1":
            ranks[1].stdin.close()
        else:
            ranks[1].send_signal(first_end)
        ranks[1].wait(DEADLINE_S)
        launcher.wait_for_a_rank_to_end(DEADLINE_S)
        observer = _ChildProcessObserver(standing_in_for_the_launcher.pid, child_processes=list(ranks.values()))
        assert observer._run()  # saw rank 1's failure and SIGKILLed the others and the "launcher"
        watch.join(DEADLINE_S)
        assert not watch.is_alive()
        assert [ranks[rank].returncode for rank in (2, 3)] == [-signal.SIGKILL] * 2
        assert capfd.readouterr().err == named.format(pid=ranks[1].pid, host=socket.gethostname())
    finally:
        for process in (*ranks.values(), standing_in_for_the_launcher):
            process.kill()
            process.wait(DEADLINE_S)
