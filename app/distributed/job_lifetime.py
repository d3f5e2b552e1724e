"""Every rank ends with its job: the workers of Lightning's launcher stop when the launching process ends.

Lightning's launcher (``_SubprocessScriptLauncher``) starts ranks 1..N-1 as child processes and kills
them only when its observer thread sees a child fail or on KeyboardInterrupt: when the launching
process (rank 0) ends any other way (a refused rendezvous, an error, SIGTERM, SIGKILL), its children
would run on with parent 1 and could join the next job started on the same port. The app's launcher
(``app.distributed.launch.JobLauncher``) hands its children its process id and a job id drawn for this
launch; each child, first thing (``python -m app``) and again in the strategy, asks Linux to kill
it when its parent ends (``prctl(PR_SET_PDEATHSIG, SIGKILL)``, ``follow_launcher``) and stops at once
if the parent is already gone. The job id names the job at the rendezvous (app/distributed/rendezvous.py),
so that a rank is never counted in another job's run. Over several nodes each node's launcher starts on
its own, so the id is one they all derive alike, without talking to each other (``shared_job_id``):
``APP_JOB_NAME`` where the user sets it, else a digest of what the nodes of one job share and two jobs
on one port do not (the command line, MASTER_ADDR, MASTER_PORT, the number of nodes).

``port_holder`` says which process holds a port, read from /proc (no connection is made: a program
that accepts a connection and never answers would hold the asker forever).

Standard library only: ``python -m app`` calls ``follow_launcher`` before it imports torch.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import signal
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LAUNCHER_PID_VARIABLE = "APP_LAUNCHER_PID"
JOB_ID_VARIABLE = "APP_JOB_ID"
JOB_NAME_VARIABLE = "APP_JOB_NAME"  # the user's name for a job of several nodes, the same on every node
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_APP_PACKAGE = __name__.split(".")[0]


@contextmanager
def children_follow_this_process(num_nodes: int) -> Iterator[None]:
    """For the launch of this process's ranks (``app.distributed.launch.JobLauncher``): the children
    started inside the block get this process's id, and a job id that this process keeps too: on one node
    a fresh one, over several nodes ``shared_job_id`` (each node's launcher draws its own otherwise)."""
    os.environ[JOB_ID_VARIABLE] = uuid.uuid4().hex[:12] if num_nodes == 1 else shared_job_id(num_nodes)
    # Only the children get the launcher's pid: a process this one starts later is no rank of it.
    os.environ[LAUNCHER_PID_VARIABLE] = str(os.getpid())
    try:
        yield
    finally:
        del os.environ[LAUNCHER_PID_VARIABLE]


def shared_job_id(num_nodes: int) -> str:
    """The id of a job of ``num_nodes`` nodes that every node's launcher computes alike, and another job
    given the same port does not: ``APP_JOB_NAME`` if set, else a digest of the command line (without the
    program's own path, which may differ by node), MASTER_ADDR, MASTER_PORT and ``num_nodes``."""
    if name := os.environ.get(JOB_NAME_VARIABLE, "").strip():
        return name
    shared = [sys.argv[1:], os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", ""), num_nodes]
    return "cmd-" + hashlib.sha256(json.dumps(shared).encode()).hexdigest()[:12]


def follow_launcher() -> None:
    """In a rank that ``JobLauncher`` started: be killed when the launching process ends, and end now
    (exit status 1, one line) if it already has. Does nothing in any other process."""
    launcher = os.environ.pop(LAUNCHER_PID_VARIABLE, "")  # not handed on to processes this rank starts
    if not launcher.isdigit() or "LOCAL_RANK" not in os.environ:
        return
    _kill_me_when_my_parent_ends()
    if os.getppid() != int(launcher):  # the launcher ended before the request above took effect
        print(
            f"error: rank {os.environ['LOCAL_RANK']}: the launching process {launcher} has ended; "
            "this rank stops with it",
            file=sys.stderr,
        )
        raise SystemExit(1)


def _kill_me_when_my_parent_ends() -> None:
    if not sys.platform.startswith("linux"):
        return  # elsewhere Lightning's own process observer is the only guard
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def port_holder(port: int) -> str:
    """Who holds TCP ``port`` on this node, for a message: "another job of this app (pid N: command)",
    "another program (pid N: command)", or "another program" where /proc does not say (another
    user's process, another system)."""
    inodes = _socket_inodes(port)
    for pid, command in _processes_with_sockets(inodes):
        shown = " ".join(" ".join(command).split())  # one line, whatever the arguments hold
        shown = shown if len(shown) <= 100 else shown[:97] + "..."
        whose = "another job of this app" if _runs_this_app(command) else "another program"
        return f"{whose} (pid {pid}: {shown})"
    return "another program"


def _socket_inodes(port: int) -> set[str]:
    """The inodes of this node's TCP sockets on ``port``, listening or connected from it (/proc lists no
    socket that is only bound: its holder stays unnamed)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()  # sl, local address:port (hex), remote, state, ..., uid, timeout, inode
            if len(fields) > 9 and int(fields[1].rsplit(":", 1)[1], 16) == port and fields[9] != "0":
                inodes.add(fields[9])
    return inodes


def _processes_with_sockets(inodes: set[str]) -> Iterator[tuple[int, list[str]]]:
    """(pid, command line) of the processes that have one of these sockets open (this user's only)."""
    links = {f"socket:[{inode}]" for inode in inodes}
    for fd_folder in Path("/proc").glob("[0-9]*/fd") if links else ():
        try:
            if any(os.readlink(fd) in links for fd in fd_folder.iterdir()):
                command = (fd_folder.parent / "cmdline").read_bytes().rstrip(b"\0").split(b"\0")
                yield int(fd_folder.parent.name), [part.decode(errors="replace") for part in command]
        except OSError:
            continue  # ended meanwhile, or another user's


def _runs_this_app(command: list[str]) -> bool:
    """Whether a command line runs this app: ``python -m app ...`` (``app.__main__`` for Lightning's ranks)."""
    modules = [command[i + 1] for i, part in enumerate(command[:-1]) if part == "-m"]
    return bool(modules) and modules[0].split(".")[0] == _APP_PACKAGE
