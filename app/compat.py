"""The one place where the app adapts to differences between the torch and TorchRec versions it supports.

Supported: torchrec 1.5 (the stack of the ROCm training image rocm/primus:v26.1, torch 2.10) to
1.9 (torch 2.14); the pins are torchrec 1.8 / torch 2.13. `make test-compat` runs the multi-process
tests on the oldest, the CUDA image's (torch 2.11, torchrec 1.6) and the newest stack. Every version
check of the app lives in this module, so that dropping an old version means deleting a branch here
and nothing else.
"""

from __future__ import annotations

from typing import Any

import torch
from packaging.version import Version
from torchrec.distributed.planner import types as planner_types
from torchrec.distributed.planner.types import Topology

# torchrec 1.6 added TopologyFactory (with TrainerConfig, HardwareConfig and KernelConfig); from 1.8 a
# Topology built directly logs a warning that it "will fail". 1.5 only has the Topology constructor.
HAS_TOPOLOGY_FACTORY = hasattr(planner_types, "TopologyFactory")

# Nightlies included: the ROCm image's torch is 2.10.0.dev20251112.
_OLDEST_SUPPORTED_TORCH = Version("2.10.0.dev0")

# (optimizer class, device type) -> the first torch whose optimizer runs with ``fused=True`` there.
# ROCm devices are device type "cuda" in torch. torch 2.10 and 2.11 accept ``Adagrad(fused=True)`` on
# CUDA in the constructor but raise at the first step() (torch/optim/adagrad.py:135,
# ``_device_dtype_check_for_fused(p, cuda_unsupported=True)``); 2.12.0 dropped that check. The first
# step is too late to fall back, hence this table decided up front. A pair not listed (TorchRec's
# RowWiseAdagrad, which takes no ``fused``; any other device type) keeps the default implementation.
_FUSED_OPTIMIZER_SINCE: dict[tuple[type[torch.optim.Optimizer], str], Version] = {
    (torch.optim.Adagrad, "cpu"): _OLDEST_SUPPORTED_TORCH,
    (torch.optim.Adagrad, "cuda"): Version("2.12.0"),
    (torch.optim.Adam, "cpu"): _OLDEST_SUPPORTED_TORCH,
    (torch.optim.Adam, "cuda"): _OLDEST_SUPPORTED_TORCH,
    (torch.optim.SGD, "cpu"): _OLDEST_SUPPORTED_TORCH,
    (torch.optim.SGD, "cuda"): _OLDEST_SUPPORTED_TORCH,
}


def fused_supported(optimizer_class: type[torch.optim.Optimizer], device_type: str, torch_version: str) -> bool:
    """Whether ``optimizer_class(..., fused=True)`` trains parameters of ``device_type`` under torch
    ``torch_version`` (e.g. ``torch.__version__``; a local tag such as ``+cpu`` or ``+rocm7.1`` counts
    for nothing, and a nightly before a release counts as older than it)."""
    since = _FUSED_OPTIMIZER_SINCE.get((optimizer_class, device_type))
    return since is not None and Version(torch_version) >= since


def create_topology(
    *,
    world_size: int,
    local_world_size: int,
    compute_device: str,
    hbm_cap: int | None,
    ddr_cap: int | None,
    hbm_mem_bw: float,
    ddr_mem_bw: float,
    hbm_to_ddr_mem_bw: float,
    intra_host_bw: float,
    inter_host_bw: float,
    bwd_compute_multiplier: float,
) -> Topology:
    """TorchRec's ``Topology`` with the given capacities (bytes) and bandwidths (bytes/ms).

    Through ``TopologyFactory`` where it exists: the trainer config carries the launch (world size,
    devices per node), the hardware config the device's figures; ``use_hardware_based_bandwidth``
    makes the factory take the bandwidths from the hardware config instead of its defaults.
    """
    if not HAS_TOPOLOGY_FACTORY:
        return Topology(
            world_size=world_size,
            local_world_size=local_world_size,
            compute_device=compute_device,
            hbm_cap=hbm_cap,
            ddr_cap=ddr_cap,
            hbm_mem_bw=hbm_mem_bw,
            ddr_mem_bw=ddr_mem_bw,
            hbm_to_ddr_mem_bw=hbm_to_ddr_mem_bw,
            intra_host_bw=intra_host_bw,
            inter_host_bw=inter_host_bw,
            bwd_compute_multiplier=bwd_compute_multiplier,
        )
    hardware: dict[str, Any] = dict(
        hbm_cap_bytes=hbm_cap,
        ddr_cap_bytes=ddr_cap,
        hbm_mem_bw=hbm_mem_bw,
        ddr_mem_bw=ddr_mem_bw,
        hbm_to_ddr_mem_bw=hbm_to_ddr_mem_bw,
        intra_host_bw=intra_host_bw,
        inter_host_bw=inter_host_bw,
    )
    return planner_types.TopologyFactory.create_topology(
        trainer_config=planner_types.TrainerConfig(world_size=world_size, local_world_size=local_world_size),
        hardware_config=planner_types.HardwareConfig(**hardware),
        kernel_config=planner_types.KernelConfig(
            compute_device=compute_device,
            bwd_compute_multiplier=bwd_compute_multiplier,
            use_hardware_based_bandwidth=True,
        ),
    )
