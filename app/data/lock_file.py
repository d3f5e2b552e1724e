"""A lock file that names its holder, safe on storage shared by many hosts: one process at a time
owns a folder (a run folder, a cache folder being converted), and whoever finds it owned can say who
owns it and whether that owner is gone.

Why not filelock: its ``FileLock`` is ``fcntl.flock`` (filelock/_unix.py), which several cluster file
systems keep node-local (Lustre mounted with ``localflock``, BeeGFS unless global file locks are
turned on), so two nodes would both "hold" it. Its ``SoftFileLock`` (an exclusively created marker,
which works across hosts) records only pid and host and never takes over a marker of another host,
while a requeued SLURM job restarts with the same job id, possibly on another node, with its old
marker still in place, and must take over; a user also needs the job and command to know whom to ask.

The lock file is JSON (:class:`Holder`: SLURM job id and restart count, host, pid, start time,
command), created whole by ``link(2)`` of a finished file under a unique name: ``link`` fails if the
name exists, on local file systems and over NFS alike, and nobody ever reads a half-written record.
A holder is gone (its lock may be taken over) when it is the same SLURM job requeued since
(``SLURM_RESTART_COUNT`` is higher here), or when it ran on this host and its process is gone. A
holder on another host cannot be probed: it is live until it releases, or until someone deletes the
file (the refusal messages say so).
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import sys
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path


@dataclass(frozen=True)
class Holder:
    """Who holds a lock: enough to tell a user whom to ask, and to tell a gone holder from a live one."""

    host: str
    pid: int
    pid_start_ticks: int | None  # the process's start (/proc/<pid>/stat), so that a reused pid is not taken for it
    started: str  # UTC, when the lock was taken
    command: str
    slurm_job_id: str | None
    slurm_restart_count: int
    token: str  # this acquisition's, so that a release or a take-over touches only the file it judged

    @classmethod
    def of_this_process(cls) -> Holder:
        pid = os.getpid()
        return cls(
            host=socket.gethostname(),
            pid=pid,
            pid_start_ticks=_start_ticks(pid),
            started=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            command=" ".join(sys.argv) or sys.executable,
            slurm_job_id=os.environ.get("SLURM_JOB_ID"),
            slurm_restart_count=int(os.environ.get("SLURM_RESTART_COUNT") or 0),
            token=secrets.token_hex(8),
        )

    def describe(self) -> str:
        job = f"SLURM job {self.slurm_job_id}, " if self.slurm_job_id else ""
        return f"{job}pid {self.pid} on {self.host} since {self.started} ({self.command})"

    def is_this_process(self, me: Holder) -> bool:
        return (self.host, self.pid, self.pid_start_ticks) == (me.host, me.pid, me.pid_start_ticks)

    def is_gone(self, me: Holder) -> bool:
        """Whether ``me`` may take this holder's lock over: a requeued job, or a process gone on this host."""
        if self.slurm_job_id and self.slurm_job_id == me.slurm_job_id and self.slurm_restart_count < me.slurm_restart_count:
            return True  # SLURM requeued this job: every process of its earlier run has ended
        if self.host != me.host:
            return False  # another host's process cannot be probed from here
        return not _process_runs(self.pid, self.pid_start_ticks)


class HolderLock:
    """The lock file ``path``: :meth:`acquire` takes it (taking over from a holder that is gone),
    :meth:`release` gives it back. Not re-entrant across instances, but a lock file naming this very
    process counts as held (a second ``fit`` in one process)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.me = Holder.of_this_process()
        self.replaced: Holder | None = None  # the gone holder taken over, for the caller to report
        self.held = False

    def acquire(self) -> Holder | None:
        """Takes the lock; returns None when held now, or the live holder that has it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(3):  # a holder that releases or is taken over while we look: look again
            if self._create():
                self.held = True
                return None
            holder = read_holder(self.path)
            if holder is None and not self.path.exists():
                continue  # released meanwhile
            if holder is not None and holder.is_this_process(self.me):
                self.me, self.held = holder, True
                return None
            if holder is not None and not holder.is_gone(self.me):
                return holder
            self._take_over(holder)
        holder = read_holder(self.path)
        return holder if holder is not None else self.me  # three races lost in a row: report as busy

    def release(self) -> None:
        """Deletes the lock file if it is still this holder's (one taken over meanwhile is left alone)."""
        if self.held:
            holder = read_holder(self.path)
            if holder is not None and holder.token == self.me.token:
                self.path.unlink(missing_ok=True)
            self.held = False

    def _create(self) -> bool:
        record = self.path.with_name(f"{self.path.name}.{self.me.host}-{self.me.pid}-{self.me.token}")
        record.write_text(json.dumps(asdict(self.me), indent=1) + "\n")
        try:
            os.link(record, self.path)  # fails if the lock file exists: only one creator wins
            return True
        except FileExistsError:
            return False
        finally:
            record.unlink(missing_ok=True)

    def _take_over(self, judged: Holder | None) -> None:
        # Moved aside by rename, which only one contender can do to the file judged; one that moved a
        # newer holder's file instead (it replaced the judged one meanwhile) puts it back.
        aside = self.path.with_name(f"{self.path.name}.gone-{self.me.token}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        taken = read_holder(aside)
        if (taken.token if taken else None) != (judged.token if judged else None):
            try:
                os.link(aside, self.path)
            except FileExistsError:
                pass  # a third contender got in between; the newer holder's file is lost (three-way race)
        else:
            self.replaced = judged
        aside.unlink(missing_ok=True)


def read_holder(path: Path) -> Holder | None:
    """The holder recorded in the lock file ``path``; None if there is none, or the file is not a
    record of this module (e.g. an empty file left by an earlier flock-based lock, which holds nothing)."""
    try:
        return Holder(**json.loads(Path(path).read_text()))
    except (FileNotFoundError, json.JSONDecodeError, TypeError, UnicodeDecodeError):
        return None


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux /proc), or None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # field 22; the name before ")" may hold spaces


def _process_runs(pid: int, start_ticks: int | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    return start_ticks is None or _start_ticks(pid) in (None, start_ticks)
