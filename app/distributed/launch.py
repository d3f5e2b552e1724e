"""Checks on how the processes were launched, and the NCCL/RCCL error-handling defaults.

When torchrun, SLURM or MPI creates the processes, Lightning trusts ``trainer.devices`` x
``trainer.num_nodes`` as the world size and never compares it with the number of processes actually
started (its check runs only in its own launcher): a mismatch would wait at the rendezvous for ranks
that do not exist. This module compares them before anything starts, gives the tasks of a
SLURM job a rendezvous port of their own (``slurm_main_port``), and refuses network-interface
settings that gloo or NCCL would fail on only after the launch (``check_network_interfaces``).
"""

from __future__ import annotations

import ipaddress
import os
import select
import signal
import socket
import subprocess
import sys
import threading

from lightning.fabric.plugins.environments import ClusterEnvironment, LightningEnvironment, SLURMEnvironment
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

from app.distributed.job_lifetime import children_follow_this_process

# Error handling of NCCL (RCCL on ROCm), set only where the user has not chosen: a collective that
# exceeds trainer.strategy.init_args.timeout_s aborts the communicator and ends the process (3 =
# tear down without cleanup, the default of torch >= 2.2, stated for older builds), and a dump of
# what each rank was doing is written for the post-mortem.
NCCL_ERROR_DEFAULTS = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
}


def set_collective_error_defaults() -> None:
    """Exports NCCL_ERROR_DEFAULTS for the variables the environment does not already set."""
    for name, value in NCCL_ERROR_DEFAULTS.items():
        os.environ.setdefault(name, value)


class JobLauncher(_SubprocessScriptLauncher):
    """Lightning's launcher of the other local ranks, whose ranks end with this process and carry this
    launch's job id (app/distributed/job_lifetime.py), and which names a rank that a signal ends."""

    def __init__(self, cluster_environment: ClusterEnvironment, num_processes: int, num_nodes: int) -> None:
        super().__init__(cluster_environment, num_processes, num_nodes)
        self._killing = threading.Event()  # set when this launcher ends its ranks itself
        self._rank_ended = threading.Event()  # set once a rank's end has been reported

    def _call_children_scripts(self) -> None:
        with children_follow_this_process(self.num_nodes):
            super()._call_children_scripts()
        first_rank = self.cluster_environment.node_rank() * self.num_processes
        ranks = {first_rank + local_rank: proc for local_rank, proc in enumerate(self.procs, start=1)}
        threading.Thread(target=self._name_ranks_a_signal_ends, args=(ranks,), daemon=True).start()

    def kill(self, signum: int) -> None:
        self._killing.set()
        super().kill(signum)

    def wait_for_a_rank_to_end(self, timeout_s: float) -> None:
        """Returns once a rank this launcher started has ended and been named, or after ``timeout_s``: a
        killed rank closes its connections a moment before its end is known, and the others' errors
        should come after its name."""
        self._rank_ended.wait(timeout_s)

    def _name_ranks_a_signal_ends(self, ranks: dict[int, subprocess.Popen]) -> None:
        """Prints one line for the rank a signal ends (SIGKILL, the OOM killer, a crash) the moment it ends:
        such a rank says nothing itself, and gloo tells the others only that a connection closed. A rank
        that exits prints its own error. Only the first rank to fail is named: once one has, Lightning's
        process observer SIGKILLs the other children (with 3 or more ranks on a node it can run before this
        process ends), and those deaths follow from the first. Waits on pidfds (Linux); elsewhere names
        nothing."""
        try:
            waiting = {os.pidfd_open(proc.pid): (rank, proc) for rank, proc in ranks.items()}
        except (AttributeError, OSError):  # no pidfds here, or a rank ended already
            return
        a_rank_failed = False
        while waiting:
            for pidfd in select.select(list(waiting), [], [])[0]:
                rank, proc = waiting.pop(pidfd)
                os.close(pidfd)
                code = proc.wait()
                if code < 0 and not a_rank_failed and not self._killing.is_set():
                    print(
                        f"error: rank {rank} (pid {proc.pid} on {socket.gethostname()}) was killed by "
                        f"{_signal_name(-code)}; the other ranks' errors follow from it",
                        file=sys.stderr,
                        flush=True,
                    )
                a_rank_failed = a_rank_failed or code != 0
                self._rank_ended.set()


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


# Ports for SLURM jobs: below Linux's ephemeral range (32768-60999, net.ipv4.ip_local_port_range), so
# that no outgoing connection of another process sits on one; from Lightning's own base.
SLURM_PORT_BASE = 15000
SLURM_PORT_COUNT = 32768 - SLURM_PORT_BASE
# A prime: the steps of one job get ports this far apart (no two of the first SLURM_PORT_COUNT collide).
_STEP_STRIDE = 1009


def check_launch(environment: ClusterEnvironment, devices: int, num_nodes: int) -> None:
    """Raises ValueError when an external launcher started another number of processes than
    ``devices`` x ``num_nodes``, or when srun started several tasks that Lightning does not see as SLURM's;
    exports the SLURM job's rendezvous port (``set_slurm_main_port``); checks the interface settings."""
    check_slurm_detected(environment)
    set_slurm_main_port(environment)
    try:
        main_address = environment.main_address
    except KeyError:  # torchrun's MASTER_ADDR missing: the rendezvous will say so
        main_address = "127.0.0.1"
    check_network_interfaces(main_address, num_nodes)
    # Lightning's own launcher (and its children) start exactly devices x num_nodes by construction.
    if not environment.creates_processes_externally or isinstance(environment, LightningEnvironment):
        return
    launcher = "SLURM (srun)" if isinstance(environment, SLURMEnvironment) else type(environment).__name__
    expected = devices * num_nodes
    launched = environment.world_size()
    if launched != expected:
        raise ValueError(
            f"{launcher} started {launched} processes, but trainer.devices x trainer.num_nodes = {devices} x "
            f"{num_nodes} = {expected}: launch {expected} processes ({devices} per node, e.g. srun "
            f"--ntasks-per-node={devices} / torchrun --nproc_per_node {devices}) or change the config"
        )
    environment.validate_settings(num_devices=devices, num_nodes=num_nodes)


def check_slurm_detected(environment: ClusterEnvironment) -> None:
    """Raises ValueError for srun tasks of a job named ``bash`` or ``interactive``: Lightning turns its SLURM
    detection off for those names (so that another launcher can run inside an interactive allocation),
    and every task would then start a launcher of its own, each with its own world of processes."""
    step_tasks = int(os.environ.get("SLURM_STEP_NUM_TASKS") or os.environ.get("SLURM_NTASKS") or 1)
    launched_by_srun = "SLURM_PROCID" in os.environ and step_tasks > 1
    job_name = SLURMEnvironment.job_name()
    if launched_by_srun and job_name in ("bash", "interactive") and not isinstance(environment, SLURMEnvironment):
        raise ValueError(
            f"srun started {step_tasks} tasks of a job named {job_name!r}, a name for which Lightning does not "
            "detect SLURM: each task would start its own processes. Give the job another name (sbatch/srun "
            "--job-name=dlrm), or run one task that launches the rest (srun --ntasks=1 ... or torchrun)"
        )


def slurm_main_port(job_id: int, step_id: int) -> int:
    """The rendezvous port of a SLURM job step: its job id modulo the 17,768 ports of SLURM_PORT_BASE..32767,
    so that any two jobs fewer than 17,768 ids apart (those that run at the same time) differ, and
    further steps of the job each get another port.

    Lightning's own rule, 15000 + the job id's last four digits (``SLURMEnvironment.main_port``), gives
    jobs 10,000 ids apart the same port: two of them sharing a node cannot both host their rendezvous.
    (Each task of a job array has a job id of its own: SLURM_JOB_ID, not SLURM_ARRAY_JOB_ID.)
    """
    return SLURM_PORT_BASE + (job_id + _STEP_STRIDE * step_id) % SLURM_PORT_COUNT


def set_slurm_main_port(environment: ClusterEnvironment) -> None:
    """Exports ``MASTER_PORT`` = ``slurm_main_port`` of SLURM_JOB_ID and SLURM_STEP_ID for a SLURM task,
    unless the user set it: Lightning's SLURM environment then reads it instead of its own rule. Every
    task of the step computes the same port from the same variables, on every node."""
    if not isinstance(environment, SLURMEnvironment) or "MASTER_PORT" in os.environ:
        return
    job_id = os.environ.get("SLURM_JOB_ID", "")
    step_id = os.environ.get("SLURM_STEP_ID", "0")
    if job_id.isdigit():  # else Lightning's default port, as without SLURM
        os.environ["MASTER_PORT"] = str(slurm_main_port(int(job_id), int(step_id) if step_id.isdigit() else 0))


def check_network_interfaces(main_address: str, num_nodes: int) -> None:
    """Raises ValueError for a GLOO_SOCKET_IFNAME or NCCL_SOCKET_IFNAME naming no interface of this node
    (gloo and NCCL fail on it only once the process group is created), and for a run of several nodes
    where gloo, left to choose, would give the other nodes a loopback address (``_gloo_host_address``)."""
    interfaces = [name for _, name in socket.if_nameindex()]
    here = f"this node ({socket.gethostname()}) has {', '.join(interfaces)}"
    gloo = os.environ.get("GLOO_SOCKET_IFNAME")
    if gloo:  # a comma-separated list of exact names (torch's ProcessGroupGloo)
        missing = [name for name in gloo.split(",") if name not in interfaces]
        if missing:
            raise ValueError(f"GLOO_SOCKET_IFNAME={gloo}: no interface {', '.join(missing)}: {here}; name one, or unset it")
    nccl = os.environ.get("NCCL_SOCKET_IFNAME")
    if nccl and not nccl.startswith("^"):  # NCCL: prefixes, "=" exact names, "^" names to avoid
        exact, wanted = nccl.startswith("="), nccl.lstrip("=").split(",")
        if not any(name == w if exact else name.startswith(w) for name in interfaces for w in wanted):
            raise ValueError(f"NCCL_SOCKET_IFNAME={nccl}: matches no interface: {here}; name one, or unset it")
    if num_nodes > 1 and not gloo and not _is_loopback(main_address):
        address = _gloo_host_address()
        if _is_loopback(address):
            raise ValueError(
                f"gloo would offer the other {num_nodes - 1} node(s) {address}, a loopback address they cannot "
                f"connect to (this node's host name {socket.gethostname()!r} resolves to it, or to nothing); set "
                f"GLOO_SOCKET_IFNAME to the interface that reaches {main_address} ({here}; with "
                "scripts/slurm_fit.sbatch: NET_IFNAME)"
            )


def _gloo_host_address() -> str:
    """The address gloo binds and offers to the other ranks when GLOO_SOCKET_IFNAME is unset: the first
    that the host name resolves to, else 127.0.0.1 (torch's ProcessGroupGloo::createDefaultDevice).
    Written here because torch has no call that returns it."""
    try:
        return socket.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM)[0][4][0]
    except (OSError, IndexError):
        return "127.0.0.1"


def _is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) is this machine's loopback; an unknown name is not."""
    try:
        return ipaddress.ip_address(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]).is_loopback
    except (OSError, IndexError, ValueError):
        return False
