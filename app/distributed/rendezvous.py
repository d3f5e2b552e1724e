"""Joining the process group with a bounded wait and a message that says what is missing.

``torch.distributed.init_process_group`` waits for the other ranks as long as the collective timeout
and then fails with a store error that names neither the missing ranks nor the address. Here every
rank first checks in at the rendezvous store (the same TCPStore ``init_process_group`` would use:
hosted by rank 0, or by torchrun's agent) and waits at most ``rendezvous_timeout_s`` for the others,
so that a node that never starts, a wrong ``MASTER_ADDR`` or a launch with fewer processes than
``trainer.devices`` x ``trainer.num_nodes`` ends every rank that did start, with one line saying why.

Also the barrier for waits longer than the collective timeout (``wait_for_every_rank``): while one
rank works alone (rank 0 publishing a checkpoint and deleting the previous one, a rank with more
shards to write), the others wait on a gloo group with its own, longer timeout instead of in an NCCL
collective, whose watchdog (``TORCH_NCCL_ASYNC_ERROR_HANDLING``) ends the job after ``timeout_s``.

Two jobs given the same port on one node (SLURM's port rule, a copied ``MASTER_PORT``): the second
job's rank 0 cannot host its store, and its other ranks would join the first job's rendezvous. Each
job checks in under its own name (SLURM job, torchrun run, the job id Lightning's launcher hands its
ranks: drawn on one node, derived alike by every node over several, app/distributed/job_lifetime.py), and
a rank that finds another job's name at the store ends at once, with a line naming both and the port.
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from app.distributed.job_lifetime import JOB_ID_VARIABLE, JOB_NAME_VARIABLE, port_holder

_POLL_S = 0.2
# The watchdog fires this long after the rendezvous timeout (a share of it, at least a second), so that torch's
# own timeout, which raises a little late on a busy machine, usually ends a rank that gets no answer at all (its
# retry after a random delay can still outlast the grace: the watchdog's line then asks the port which case it is).
_WATCHDOG_GRACE_SHARE, _WATCHDOG_GRACE_MIN_S = 0.05, 1.0
_FIX = "raise trainer.strategy.init_args.rendezvous_timeout_s if nodes start far apart"
_PORT_FIX = (
    "export MASTER_PORT=<a free port, 1024-32767> for every task of the job (under SLURM the app derives it "
    "from the job and step id: app/distributed/launch.py)"
)
_OWNER_KEY = "app_rendezvous/job"


class RendezvousError(ValueError):
    """Not every rank joined in time; the message names the address, the missing ranks and nodes."""


def join_process_group(
    backend: str,
    *,
    address: str,
    port: int,
    rank: int,
    world_size: int,
    processes_per_node: int,
    rendezvous_timeout_s: float,
    timeout_s: float,
    device_id: torch.device | None = None,
) -> None:
    """Waits up to ``rendezvous_timeout_s`` for all ``world_size`` ranks at ``address:port``, then
    creates the default process group, whose collectives give up after ``timeout_s``."""
    if dist.is_initialized():
        return  # a second trainer.validate()/test() in the same processes
    where = f"{address}:{port}"
    store = _connect(address, port, rank, world_size, rendezvous_timeout_s)
    job = job_name()
    _check_the_store_is_this_jobs(store, where, rank, job, world_size > processes_per_node)
    _wait_for_everyone(store, where, rank, world_size, processes_per_node, rendezvous_timeout_s, job)
    store.set_timeout(timedelta(seconds=timeout_s))
    kwargs = {"device_id": device_id} if device_id is not None else {}
    # The same prefix init_process_group gives a store it creates itself.
    dist.init_process_group(
        backend,
        store=dist.PrefixStore("default_pg", store),
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
        **kwargs,
    )
    # Before the interpreter shuts down: torch warns about NCCL groups left at exit, and gloo's worker
    # threads torn down during finalisation can abort the process ("terminate called without an active
    # exception", SIGABRT), which a validate run on 2 CPU processes hit once at its very end.
    atexit.register(_destroy_process_group)


# One gloo group per (default group, timeout): created at the first barrier, on every rank at once.
_long_wait_groups: dict[tuple[int, float], dist.ProcessGroup] = {}


def long_wait_group(timeout_s: float) -> dist.ProcessGroup:
    """A gloo group of every rank whose collectives wait up to ``timeout_s``; every rank must ask for it
    at the same point of the program (creating a group is a collective), as for any barrier.

    Gloo, whatever the default backend: NCCL has no monitored barrier, and a wait there counts against
    the NCCL watchdog's timeout. A rank that dies still ends the wait at once: gloo sees its
    connection close (only a rank that is alive but stuck makes the others wait the whole timeout).
    """
    key = (id(dist.group.WORLD), timeout_s)
    if key not in _long_wait_groups:
        _long_wait_groups[key] = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    return _long_wait_groups[key]


def wait_for_every_rank(timeout_s: float) -> None:
    """A barrier of all ranks that waits up to ``timeout_s`` and then names the ranks that never came."""
    dist.monitored_barrier(group=long_wait_group(timeout_s), timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)


def _destroy_process_group() -> None:
    _long_wait_groups.clear()
    if dist.is_initialized():
        dist.destroy_process_group()


def _connect(address: str, port: int, rank: int, world_size: int, timeout_s: float) -> dist.Store:
    # Under torchrun the agent of node 0 already hosts the store on MASTER_PORT (as torch's own
    # env:// rendezvous does, read from the variable torchrun sets); otherwise rank 0 hosts it.
    hosted_by_agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    hosting = rank == 0 and not hosted_by_agent
    # A client whose connection is accepted by a program that never answers (not a TCPStore) waits in
    # torch's handshake forever, whatever its timeout: the watchdog ends the process instead.
    watchdog = None if hosting else _not_a_store_watchdog(address, port, rank, world_size, timeout_s)
    try:
        return dist.TCPStore(
            address,
            port,
            world_size,
            is_master=hosting,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
            multi_tenant=True,
        )
    except RuntimeError as error:  # DistNetworkError / DistStoreError: unreachable, or the port is taken
        if hosting and "EADDRINUSE" in str(error):
            raise RendezvousError(
                f"rank 0 could not host the rendezvous at {address}:{port}: port {port} is already in use on this "
                f"node by {port_holder(port)}; this job stops; {_PORT_FIX}"
            ) from None
        if hosting:
            raise RendezvousError(f"rank 0 could not host the rendezvous at {address}:{port}: {error}") from None
        if "Ping failed" in str(error):  # a program answered, but not as a TCPStore does
            raise RendezvousError(_not_a_store(address, port, rank, world_size, timeout_s)) from None
        raise RendezvousError(_no_answer(address, port, rank, world_size, timeout_s)) from None
    finally:
        if watchdog is not None:
            watchdog.cancel()


def _no_answer(address: str, port: int, rank: int, world_size: int, timeout_s: float) -> str:
    return (
        f"rank {rank} of {world_size} waited {timeout_s:g} s to reach the rendezvous at {address}:{port} and "
        "got no answer: is node 0 started? check MASTER_ADDR and MASTER_PORT (they must name node 0 on every "
        f"node); {_FIX}"
    )


def _not_a_store(address: str, port: int, rank: int, world_size: int, timeout_s: float) -> str:
    return (
        f"rank {rank} of {world_size}: {address}:{port} is not a rendezvous of this app (no TCPStore answered "
        f"within {timeout_s:g} s; another program holds port {port} there): check MASTER_ADDR and MASTER_PORT "
        "(they must name node 0's rendezvous, on every node), or free the port on that node"
    )


def _not_a_store_watchdog(address: str, port: int, rank: int, world_size: int, timeout_s: float) -> threading.Timer:
    """A started timer that, unless cancelled within ``timeout_s`` and a grace period (torch's own timeout
    raises first where it applies), prints the line of ``_not_a_store`` and ends the process with status 2:
    the blocked C++ call cannot be interrupted, and exit handlers would wait on it."""

    def end_the_process() -> None:
        # On a busy machine torch's own timeout (no listener at all) can raise after the watchdog: which case
        # this is, a program that took the connection or nobody there, is asked of the port itself.
        taken = accepts_connections(address, port)
        line = (_not_a_store if taken else _no_answer)(address, port, rank, world_size, timeout_s)
        print(f"error: {line}", file=sys.stderr, flush=True)
        os._exit(2)

    grace_s = max(_WATCHDOG_GRACE_MIN_S, _WATCHDOG_GRACE_SHARE * timeout_s)
    watchdog = threading.Timer(timeout_s + grace_s, end_the_process)
    watchdog.daemon = True
    watchdog.start()
    return watchdog


def accepts_connections(address: str, port: int, timeout_s: float = 2.0) -> bool:
    """Whether a program at ``address:port`` takes a TCP connection (closed at once, nothing sent, so a
    program that never answers cannot hold this check)."""
    try:
        with socket.create_connection((address, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def job_name() -> str:
    """What names this job to the ranks of another job that reach its rendezvous: SLURM's job id (not the
    step's: nodes started by separate srun steps of one job are one run), torchrun's run id; under Lightning's
    launcher the job id it hands its ranks (app/distributed/job_lifetime.py: drawn on one node, derived alike
    by every node over several)."""
    if "SLURM_JOB_ID" in os.environ:
        return f"SLURM job {os.environ['SLURM_JOB_ID']}"
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return f"torchrun run {os.environ['TORCHELASTIC_RUN_ID']}"
    if os.environ.get(JOB_ID_VARIABLE):
        return f"job {os.environ[JOB_ID_VARIABLE]}"
    return ""


def _check_the_store_is_this_jobs(store: dist.Store, where: str, rank: int, job: str, several_nodes: bool) -> None:
    """Rank 0 writes the job's name at the store; another rank raises when it finds another job's there
    (rank 0 may not have written it yet: ``_wait_for_everyone`` looks again while it waits)."""
    if rank == 0:
        store.set(_OWNER_KEY, job)
        return
    owner = store.get(_OWNER_KEY).decode() if store.check([_OWNER_KEY]) else job
    if owner == job:
        return
    found = f"rank {rank} of {job or 'this job'} found the rendezvous at {where} held by {owner or 'another job'}"
    if several_nodes and "SLURM_JOB_ID" not in os.environ and "TORCHELASTIC_RUN_ID" not in os.environ:
        # Named alike by the launchers of every node (app/distributed/job_lifetime.py's shared_job_id).
        raise RendezvousError(
            f"{found}: two jobs were given the same MASTER_ADDR and MASTER_PORT; {_PORT_FIX}. If both are nodes of "
            f"one job, export the same {JOB_NAME_VARIABLE}=<a name for the job> on every node (without it the name "
            "is derived from the command line, MASTER_ADDR, MASTER_PORT and trainer.num_nodes, which must then match)"
        )
    raise RendezvousError(f"{found}: two jobs were given the same port on one node; {_PORT_FIX}")


def _wait_for_everyone(
    store: dist.Store, where: str, rank: int, world_size: int, processes_per_node: int, timeout_s: float, job: str
) -> None:
    # A restarted torchrun job reuses the agent's store: count each attempt under its own prefix; and each
    # job under its own name, so that ranks of another job that reach this store are never counted.
    owner_store = store
    store = dist.PrefixStore(f"app_rendezvous/{job}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    store.set(f"rank{rank}", "joined")
    joined = store.add("joined", 1)
    deadline = time.monotonic() + timeout_s
    try:
        while joined < world_size and time.monotonic() < deadline:
            time.sleep(_POLL_S)
            joined = store.add("joined", 0)
            if rank != 0:
                _check_the_store_is_this_jobs(owner_store, where, rank, job, world_size > processes_per_node)
        if joined >= world_size:
            return
        missing = [r for r in range(world_size) if not store.check([f"rank{r}"])]
    except RuntimeError:  # rank 0 gave up first and took its store with it
        raise RendezvousError(
            f"rank {rank}: lost the rendezvous at {where} while waiting for {world_size} ranks; see rank 0's message"
        ) from None
    nodes = sorted({r // processes_per_node for r in missing})
    raise RendezvousError(
        f"waited {timeout_s:g} s for {world_size} ranks at {where}; {joined} joined, missing rank(s) "
        f"{_span(missing)} of node(s) {_span(nodes)}: is node {nodes[0]} started (NODE_RANK={nodes[0]}), and does "
        f"it use this MASTER_ADDR/MASTER_PORT? devices x num_nodes must equal the processes launched; {_FIX}"
    )


def _span(numbers: list[int]) -> str:
    shown = ", ".join(str(n) for n in numbers[:8])
    return shown + (f" ... ({len(numbers)} in all)" if len(numbers) > 8 else "")
