"""The one place where the app adapts to differences between the TorchRec versions it supports.

Supported: torchrec 1.5 (the stack of the ROCm training image rocm/primus:v26.1, torch 2.10) to
1.9 (torch 2.14); the pins are torchrec 1.8 / torch 2.13. `make test-compat` runs the multi-process
tests on the oldest and the newest stack. Every version check of the app lives in this module, so
that dropping an old version means deleting a branch here and nothing else.
"""

from __future__ import annotations

from typing import Any

from torchrec.distributed.planner import types as planner_types
from torchrec.distributed.planner.types import Topology

# torchrec 1.6 added TopologyFactory (with TrainerConfig, HardwareConfig and KernelConfig); from 1.8 a
# Topology built directly logs a warning that it "will fail". 1.5 only has the Topology constructor.
HAS_TOPOLOGY_FACTORY = hasattr(planner_types, "TopologyFactory")


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
