"""A process group that carries tensors in host memory, whatever backend the run's default group has.

Exact AUC and the predictions file gather what every rank saw; held on the GPU that would take GBs
of the memory the tables fill. Gathered on the host instead, they need a group that carries CPU
tensors: NCCL (RCCL on ROCm) carries only GPU tensors (torch's ``Backend.backend_capability``), so
under it this builds a gloo group over the same ranks, from the default group's store.
"""

from __future__ import annotations

import torch.distributed as dist


def host_process_group() -> dist.ProcessGroup | None:
    """The group to gather CPU tensors through: None (the default group) where the default group
    carries them, else a new gloo group over all ranks. A single NCCL process needs one too:
    torchmetrics gathers whatever the world size, and NCCL refuses a CPU tensor ("No backend type
    associated with device type cpu", every validation of a 1-GPU fit on an H200).

    Collective the first time in a process group: every rank must call it at the same point (e.g. in
    a ``setup`` hook); later calls return the same group.
    """
    if not dist.is_available() or not dist.is_initialized():
        return None
    if carries_host_tensors():
        return None
    # One per default group: the exact AUC (every fit/validate/test setup) and the predictions writer
    # share it, instead of each setup creating another gloo group (a collective with its own sockets).
    # The default group is kept with it, so a process group set up anew after a destroy gets its own.
    world = dist.group.WORLD
    if _host_group[0] is not world:
        _host_group[:] = [world, dist.new_group(backend="gloo")]
    return _host_group[1]


_host_group: list = [None, None]  # [the default group it was made for, the gloo group]


def carries_host_tensors(group: dist.ProcessGroup | None = None) -> bool:
    """Whether ``group`` (default: the default group) has a backend for CPU tensors."""
    # "cpu:gloo,cuda:gloo" under gloo, "cuda:nccl" under nccl, "cpu:gloo,cuda:nccl" when both were asked for.
    return any(pair.split(":")[0] == "cpu" for pair in dist.get_backend_config(group).split(","))
