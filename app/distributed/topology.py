"""Hardware presets for TorchRec's sharding planner: memory and bandwidth of each supported device.

The planner chooses between keeping a table whole on one device, replicating it (data-parallel) or
splitting it, by estimating each option's memory and its cost per step from the device's memory
capacities and bandwidths. Without them it assumes a 32 GB device with a V100's bandwidths, which
makes it split tables that an MI300X or an H200 could simply hold (ROCm blog, "Streamlining
Recommendation Model Training on AMD Instinct GPUs", March 2026:
https://rocm.blogs.amd.com/artificial-intelligence/recsys-training-docker/README.html).

A preset is chosen by name in YAML (``trainer.strategy.init_args.topology: mi300x``), or ``auto``
picks it from the device's name and takes as HBM capacity the memory *free* on the device when the
plan is made (``torch.cuda.mem_get_info``: the total less the CUDA/HIP context, other processes and
anything already allocated), the least over all ranks (app/distributed/sharding.py). Every figure can
be overridden (``topology_overrides: {hbm_cap_bytes: ...}``), and so can the share of it the planner
leaves to everything but the tables (``hbm_reserved_fraction``, ``hbm_reserved_bytes``). World size and
devices per node are never part of a preset: they always come from the launch.

Units: capacities in bytes (HBM and host memory as marketed, i.e. GiB, which is what the devices
report); bandwidths in GB/s (10^9 bytes per second, as vendors publish them), converted to the
planner's bytes per millisecond in one place (``to_torchrec_kwargs``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

GIB = 1024**3

TOPOLOGY_CHOICES = ("auto", "cpu", "mi300x", "mi325x", "mi355x", "a100", "h100", "h200", "b200")


@dataclass(frozen=True)
class DeviceTopology:
    """Memory and bandwidth of one device (GPU or CPU process) and of its links, as the planner uses them.

    Args:
        name: the preset's name (``mi300x`` ...), or where the figures came from.
        compute_device: ``cuda`` for GPUs (ROCm GPUs report ``cuda`` too) or ``cpu``.
        hbm_cap_bytes: HBM per GPU (0 on CPU).
        hbm_bw_gb_per_s: HBM bandwidth.
        ddr_cap_bytes: host memory the planner may use per device (for UVM / host-resident tables).
        ddr_bw_gb_per_s: host memory bandwidth available to one device.
        hbm_to_ddr_bw_gb_per_s: GPU <-> host link (PCIe) bandwidth.
        intra_node_bw_gb_per_s: device-to-device bandwidth inside a node (xGMI, NVLink).
        inter_node_bw_gb_per_s: bandwidth between nodes per device (the NIC of each GPU).
        bwd_compute_multiplier: backward compute cost relative to forward (TorchRec's default is 2).
        hbm_reserved_fraction: share of ``hbm_cap_bytes`` the planner leaves free for what neither
            TorchRec's reservation nor its shard estimates count: activations of the dense part, NCCL's
            and the all-to-all's buffers, the allocator's fragmentation (see app/distributed/sharding.py,
            ``memory_reservation``, for what is reserved besides).
        hbm_reserved_bytes: a fixed amount the planner also leaves free on each GPU (0 on CPU), for a
            known extra (e.g. NCCL buffers grown with ``NCCL_BUFFSIZE``, another model on the GPU).
        hbm_cap_source: where ``hbm_cap_bytes`` came from (a preset, the device's free memory, an override).
    """

    name: str
    compute_device: str
    hbm_cap_bytes: int
    hbm_bw_gb_per_s: float
    ddr_cap_bytes: int
    ddr_bw_gb_per_s: float
    hbm_to_ddr_bw_gb_per_s: float
    intra_node_bw_gb_per_s: float
    inter_node_bw_gb_per_s: float
    bwd_compute_multiplier: float = 2.0
    hbm_reserved_fraction: float = 0.15
    hbm_reserved_bytes: int = 0
    hbm_cap_source: str = "preset"

    def to_torchrec_kwargs(self) -> dict[str, Any]:
        """The figures under the names of TorchRec's ``Topology`` arguments, bandwidths in bytes/ms."""

        def bytes_per_ms(gb_per_s: float) -> float:
            return gb_per_s * 1e9 / 1e3

        return {
            "compute_device": self.compute_device,
            "hbm_cap": self.hbm_cap_bytes,
            "ddr_cap": self.ddr_cap_bytes,
            "hbm_mem_bw": bytes_per_ms(self.hbm_bw_gb_per_s),
            "ddr_mem_bw": bytes_per_ms(self.ddr_bw_gb_per_s),
            "hbm_to_ddr_mem_bw": bytes_per_ms(self.hbm_to_ddr_bw_gb_per_s),
            "intra_host_bw": bytes_per_ms(self.intra_node_bw_gb_per_s),
            "inter_host_bw": bytes_per_ms(self.inter_node_bw_gb_per_s),
            "bwd_compute_multiplier": self.bwd_compute_multiplier,
        }


OVERRIDABLE_FIELDS = tuple(
    f.name for f in dataclasses.fields(DeviceTopology) if f.name not in ("name", "compute_device", "hbm_cap_source")
)
HBM_FREE_AT_PLANNING = "free on the device when planning"

# PCIe gen5 x16: 128 GB/s both directions together (64 GB/s each way), the host link of every GPU below.
_PCIE5_X16_GB_PER_S = 128.0
# One 400 Gb/s NIC per GPU (ConnectX-7 / AMD Pollara 400 class, the usual scale-out design of these nodes).
_NIC_400G_GB_PER_S = 50.0

PRESETS: dict[str, DeviceTopology] = {
    # AMD Instinct MI300X, node of 8 (ROCm blog above): 192 GB HBM3 at 5.3 TB/s, 1 TB of host memory
    # per GPU by default, ~370 GB/s host memory bandwidth, PCIe gen5 x16 128 GB/s, ~336 GB/s xGMI.
    "mi300x": DeviceTopology(
        name="mi300x",
        compute_device="cuda",
        hbm_cap_bytes=192 * GIB,
        hbm_bw_gb_per_s=5300.0,
        ddr_cap_bytes=1024 * GIB,
        ddr_bw_gb_per_s=370.0,
        hbm_to_ddr_bw_gb_per_s=_PCIE5_X16_GB_PER_S,
        intra_node_bw_gb_per_s=336.0,
        inter_node_bw_gb_per_s=_NIC_400G_GB_PER_S,
    ),
    # AMD Instinct MI325X (AMD data sheet): 256 GB HBM3E at 6 TB/s; same platform (host memory, PCIe
    # gen5, 7 xGMI links at MI300X speed) as the MI300X node above.
    "mi325x": DeviceTopology(
        name="mi325x",
        compute_device="cuda",
        hbm_cap_bytes=256 * GIB,
        hbm_bw_gb_per_s=6000.0,
        ddr_cap_bytes=1024 * GIB,
        ddr_bw_gb_per_s=370.0,
        hbm_to_ddr_bw_gb_per_s=_PCIE5_X16_GB_PER_S,
        intra_node_bw_gb_per_s=336.0,
        inter_node_bw_gb_per_s=_NIC_400G_GB_PER_S,
    ),
    # AMD Instinct MI355X (AMD data sheet): 288 GB HBM3E at 8 TB/s; 7 Infinity Fabric links at
    # 153.6 GB/s peak against the MI300X's 128 GB/s, so the blog's 336 GB/s xGMI figure scaled by
    # 153.6/128 = 403 GB/s. Host side as the MI300X node.
    "mi355x": DeviceTopology(
        name="mi355x",
        compute_device="cuda",
        hbm_cap_bytes=288 * GIB,
        hbm_bw_gb_per_s=8000.0,
        ddr_cap_bytes=1024 * GIB,
        ddr_bw_gb_per_s=370.0,
        hbm_to_ddr_bw_gb_per_s=_PCIE5_X16_GB_PER_S,
        intra_node_bw_gb_per_s=403.0,
        inter_node_bw_gb_per_s=_NIC_400G_GB_PER_S,
    ),
    # NVIDIA A100 80GB SXM (data sheet): 80 GB HBM2e at 2,039 GB/s, NVLink 3 600 GB/s, PCIe gen4
    # 64 GB/s. DGX A100 (data sheet): 2 TB host memory / 8 GPUs, 2x AMD EPYC 7742 with 8 channels
    # of DDR4-3200 each (2 x 204.8 GB/s) / 8 GPUs; 8x 200 Gb/s HDR InfiniBand (25 GB/s per GPU).
    "a100": DeviceTopology(
        name="a100",
        compute_device="cuda",
        hbm_cap_bytes=80 * GIB,
        hbm_bw_gb_per_s=2039.0,
        ddr_cap_bytes=256 * GIB,
        ddr_bw_gb_per_s=51.2,
        hbm_to_ddr_bw_gb_per_s=64.0,
        intra_node_bw_gb_per_s=600.0,
        inter_node_bw_gb_per_s=25.0,
    ),
    # NVIDIA H100 SXM (data sheet): 80 GB HBM3 at 3.35 TB/s, NVLink 4 900 GB/s, PCIe gen5 128 GB/s.
    # DGX H100 (data sheet): 2 TB host memory / 8 GPUs, 2x Xeon 8480C with 8 channels of DDR5-4800
    # each (2 x 307 GB/s) / 8 GPUs; 8x 400 Gb/s ConnectX-7.
    "h100": DeviceTopology(
        name="h100",
        compute_device="cuda",
        hbm_cap_bytes=80 * GIB,
        hbm_bw_gb_per_s=3350.0,
        ddr_cap_bytes=256 * GIB,
        ddr_bw_gb_per_s=76.8,
        hbm_to_ddr_bw_gb_per_s=_PCIE5_X16_GB_PER_S,
        intra_node_bw_gb_per_s=900.0,
        inter_node_bw_gb_per_s=_NIC_400G_GB_PER_S,
    ),
    # NVIDIA H200 SXM (data sheet): 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s, PCIe gen5 128 GB/s.
    # DGX H200: the DGX H100 host (2 TB, 2x Xeon 8480C) and network.
    "h200": DeviceTopology(
        name="h200",
        compute_device="cuda",
        hbm_cap_bytes=141 * GIB,
        hbm_bw_gb_per_s=4800.0,
        ddr_cap_bytes=256 * GIB,
        ddr_bw_gb_per_s=76.8,
        hbm_to_ddr_bw_gb_per_s=_PCIE5_X16_GB_PER_S,
        intra_node_bw_gb_per_s=900.0,
        inter_node_bw_gb_per_s=_NIC_400G_GB_PER_S,
    ),
    # NVIDIA B200 (DGX B200 data sheet): 1,440 GB HBM3e / 8 = 180 GB per GPU at 8 TB/s, NVLink 5
    # 1.8 TB/s, PCIe gen5 128 GB/s to the host; 2 TB host memory / 8, 2x Xeon 8570 with 8 channels
    # of DDR5-5600 each (2 x 358 GB/s) / 8 GPUs; 8x 400 Gb/s ConnectX-7.
    "b200": DeviceTopology(
        name="b200",
        compute_device="cuda",
        hbm_cap_bytes=180 * GIB,
        hbm_bw_gb_per_s=8000.0,
        ddr_cap_bytes=256 * GIB,
        ddr_bw_gb_per_s=89.6,
        hbm_to_ddr_bw_gb_per_s=_PCIE5_X16_GB_PER_S,
        intra_node_bw_gb_per_s=1800.0,
        inter_node_bw_gb_per_s=_NIC_400G_GB_PER_S,
    ),
    # CPU processes (gloo): no HBM. The other figures are TorchRec's defaults (planner/constants.py),
    # in GB/s: 128 GiB host memory, DDR 51 GiB/s, intra-node 600 GiB/s, inter-node 12.5 GiB/s.
    "cpu": DeviceTopology(
        name="cpu",
        compute_device="cpu",
        hbm_cap_bytes=0,
        hbm_bw_gb_per_s=897 * GIB / 1e9,
        ddr_cap_bytes=128 * GIB,
        ddr_bw_gb_per_s=51 * GIB / 1e9,
        hbm_to_ddr_bw_gb_per_s=32 * GIB / 1e9,
        intra_node_bw_gb_per_s=600 * GIB / 1e9,
        inter_node_bw_gb_per_s=12.5 * GIB / 1e9,
    ),
}

# A GPU whose name matches no preset: TorchRec's default bandwidths, with the HBM read from the device.
_UNKNOWN_GPU = dataclasses.replace(PRESETS["cpu"], name="gpu (TorchRec defaults)", compute_device="cuda")

# Substrings of torch.cuda.get_device_name() -> preset, most specific first ("MI300X" before "MI300").
# ROCm names look like "AMD Instinct MI300X" (or "... MI300X VF" under virtualisation), CUDA names
# like "NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA B200", "NVIDIA A100-SXM4-80GB".
_DEVICE_NAME_PATTERNS: tuple[tuple[str, str], ...] = (
    ("MI355X", "mi355x"),
    ("MI350X", "mi355x"),
    ("MI325X", "mi325x"),
    ("MI300X", "mi300x"),
    ("B200", "b200"),
    ("H200", "h200"),
    ("H100", "h100"),
    ("A100", "a100"),
)


def preset_for_device_name(device_name: str) -> str | None:
    """The preset for a GPU as ``torch.cuda.get_device_name`` names it; None when none matches."""
    upper = device_name.upper()
    for pattern, preset in _DEVICE_NAME_PATTERNS:
        if pattern in upper:
            return preset
    return None


def detect_topology(device: torch.device) -> DeviceTopology:
    """``auto``: the preset of the device the process runs on, with the HBM free on it now as capacity.

    Free, not total: the CUDA/HIP context (several hundred MiB), another process on the same GPU or
    memory this process already holds are not the planner's to fill. Each rank reads its own device;
    the planner on rank 0 takes the least over ranks (``sharding.plan_sharding``).
    """
    if device.type == "cpu":
        return PRESETS["cpu"]
    name = preset_for_device_name(torch.cuda.get_device_name(device))
    base = PRESETS[name] if name is not None else _UNKNOWN_GPU
    free_bytes, _total_bytes = torch.cuda.mem_get_info(device)
    return dataclasses.replace(base, hbm_cap_bytes=int(free_bytes), hbm_cap_source=HBM_FREE_AT_PLANNING)


def validate_topology_settings(topology: str, overrides: Mapping[str, Any] | None) -> None:
    """Raises a ValueError naming the setting for an unknown preset, an unknown field or a bad value."""
    if topology not in TOPOLOGY_CHOICES:
        raise ValueError(
            f"strategy.topology = {topology!r} is not a preset; choose one of {', '.join(TOPOLOGY_CHOICES)}"
        )
    unknown = sorted(set(overrides or {}) - set(OVERRIDABLE_FIELDS))
    if unknown:
        raise ValueError(
            f"strategy.topology_overrides: unknown field(s) {', '.join(unknown)}; "
            f"valid fields are {', '.join(OVERRIDABLE_FIELDS)}"
        )
    for field, value in (overrides or {}).items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise ValueError(f"strategy.topology_overrides.{field} = {value!r}: expected a non-negative number")
    fraction = (overrides or {}).get("hbm_reserved_fraction", 0.0)
    if fraction >= 1:
        raise ValueError(
            f"strategy.topology_overrides.hbm_reserved_fraction = {fraction!r}: expected a share of HBM below 1 "
            "(e.g. 0.15)"
        )


def resolve_topology(
    topology: str, overrides: Mapping[str, Any] | None, device: torch.device
) -> DeviceTopology:
    """The preset named ``topology`` (or detected for ``auto``) with ``overrides`` applied.

    Raises a ValueError naming the setting for an unknown preset or field, or a preset whose device
    type differs from the one the run uses (a GPU preset for CPU processes, or the reverse).
    """
    validate_topology_settings(topology, overrides)
    resolved = detect_topology(device) if topology == "auto" else PRESETS[topology]
    expected = "cpu" if device.type == "cpu" else "cuda"
    if resolved.compute_device != expected:
        raise ValueError(
            f"strategy.topology = {topology!r} describes {resolved.compute_device} devices but this run uses "
            f"{device.type}; use auto, or {'cpu' if expected == 'cpu' else 'a GPU preset'}"
        )
    overrides = dict(overrides or {})
    if overrides:
        typed: dict[str, Any] = {
            field: int(value) if field.endswith("_bytes") else float(value) for field, value in overrides.items()
        }
        if "hbm_cap_bytes" in typed:
            typed["hbm_cap_source"] = "topology_overrides.hbm_cap_bytes"
        resolved = dataclasses.replace(resolved, name=f"{resolved.name} + overrides", **typed)
    return resolved
