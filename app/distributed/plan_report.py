"""The sharding plan as a document to read and keep: per rank, its shards, their memory and estimated cost.

Written at start-up into the run folder as ``sharding_plan.json`` (machine-readable; its ``plan``
entry turns back into the exact ShardingPlan with :func:`read_plan`) and ``sharding_plan.txt``
(the same for people). Estimates are TorchRec's planner's own: bytes of HBM and host memory per
shard and milliseconds per step (forward and backward compute and communication), summed per rank
the way its performance model rates a plan (the slowest rank sets the step time). Also: the memory
the planner left to the tables per device and what it kept back for the rest (``memory_budget``),
the HBM figure it planned for and where it came from (with topology ``auto``: the least free on any
rank), the tables a UVM kernel keeps in host memory (``host_memory_tables``), and per table
(``tables``) its kernel, weights precision, UVM cache load factor and estimated HBM and host memory.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from torchrec.distributed.types import ShardingPlan

from app.checkpoint.plan_json import plan_from_json, plan_to_json
from app.distributed.sharding import (
    UVM_CACHING_KERNEL,
    PlannedSharding,
    cache_load_factor,
    format_plan,
    host_memory_tables,
    host_memory_warning,
    keeps_rows_in_host_memory,
    natural_key,
)
from app.distributed.topology import DeviceTopology

REPORT_JSON = "sharding_plan.json"
REPORT_TEXT = "sharding_plan.txt"


def plan_report(
    planned: PlannedSharding,
    *,
    device: DeviceTopology,
    world_size: int,
    local_world_size: int,
    objective: str,
    source: str,
) -> dict[str, Any]:
    """The report as JSON-ready data. ``source`` says where the plan came from (the planner or a checkpoint);
    ``device`` is what the run resolved, replaced by the figures the planner used where it made the plan."""
    device = planned.topology or device
    ranks = []
    for rank in range(world_size):
        shards = [e for e in planned.estimates if e.rank == rank]
        ranks.append(
            {
                "rank": rank,
                "hbm_bytes": sum(e.hbm_bytes for e in shards),
                "ddr_bytes": sum(e.ddr_bytes for e in shards),
                "estimated_ms_per_step": sum(e.total_ms for e in shards),
                "shards": [dataclasses.asdict(e) for e in shards],
            }
        )
    return {
        "source": source,
        "world_size": world_size,
        "local_world_size": local_world_size,
        "objective": objective,
        "topology": dataclasses.asdict(device),
        "has_estimates": bool(planned.estimates),
        "estimated_ms_per_step": max((r["estimated_ms_per_step"] for r in ranks), default=0.0),
        "memory_budget": dataclasses.asdict(planned.memory_budget) if planned.memory_budget else None,
        "host_memory_tables": host_memory_tables(planned.plan),
        "host_memory_warning": host_memory_warning(planned),
        "tables": table_summaries(planned),
        "ranks": ranks,
        "plan": plan_to_json(planned.plan),
    }


def table_summaries(planned: PlannedSharding) -> list[dict[str, Any]]:
    """Per table, in natural order: its sharding type and kernel, its weights precision (None for a plan the
    planner did not make here), the HBM cache's load factor (UVM caching only; the planner's and FBGEMM's
    0.2 when not set) and the planner's HBM and host memory estimate over all its shards."""
    estimates: dict[str, list] = {}
    for estimate in planned.estimates:
        estimates.setdefault(estimate.table, []).append(estimate)
    summaries = []
    for module_plan in planned.plan.plan.values():
        for name, sharding in module_plan.items():  # type: ignore[union-attr]
            shards = estimates.get(name, [])
            load_factor = shards[0].cache_load_factor if shards else None
            if not shards and sharding.compute_kernel == UVM_CACHING_KERNEL:
                load_factor = cache_load_factor(sharding)
            summaries.append(
                {
                    "table": name,
                    "sharding_type": sharding.sharding_type,
                    "compute_kernel": sharding.compute_kernel,
                    "precision": shards[0].precision if shards else None,
                    "cache_load_factor": load_factor,
                    "hbm_bytes": sum(e.hbm_bytes for e in shards),
                    "ddr_bytes": sum(e.ddr_bytes for e in shards),
                    "in_host_memory": keeps_rows_in_host_memory(sharding.compute_kernel),
                }
            )
    return sorted(summaries, key=lambda summary: natural_key(summary["table"]))


def format_report(report: dict[str, Any]) -> str:
    """The report as text: the settings, the plan table, then per rank its shards with their estimates."""
    topology = report["topology"]
    lines = [
        f"TorchRec sharding plan: {report['world_size']} ranks ({report['local_world_size']} per node), "
        f"from {report['source']}",
        f"topology {topology['name']}: HBM {_gib(topology['hbm_cap_bytes'])} at {topology['hbm_bw_gb_per_s']:g} GB/s, "
        f"host {_gib(topology['ddr_cap_bytes'])} at {topology['ddr_bw_gb_per_s']:g} GB/s, "
        f"HBM<->host {topology['hbm_to_ddr_bw_gb_per_s']:g} GB/s, intra-node {topology['intra_node_bw_gb_per_s']:g} GB/s, "
        f"inter-node {topology['inter_node_bw_gb_per_s']:g} GB/s; objective {report['objective']}",
        f"HBM figure: {topology.get('hbm_cap_source', 'preset')}",
        *_budget_lines(report.get("memory_budget")),
        "",
        format_plan(read_plan(report)),
        "",
    ]
    if report.get("host_memory_warning"):
        lines += [f"WARNING: {report['host_memory_warning']}", ""]
    lines += _table_lines(report.get("tables") or [], report["has_estimates"])
    if not report["has_estimates"]:
        lines.append("No planner estimates: this plan was not made by the planner in this run.")
        return "\n".join(lines) + "\n"
    lines.append(f"Estimated step time (slowest rank): {report['estimated_ms_per_step']:.3f} ms")
    for rank in report["ranks"]:
        lines.append(
            f"rank {rank['rank']}: {len(rank['shards'])} shards, HBM {_gib(rank['hbm_bytes'])}, "
            f"host {_gib(rank['ddr_bytes'])}, {rank['estimated_ms_per_step']:.3f} ms/step"
        )
        for shard in rank["shards"]:
            size = "x".join(str(s) for s in shard["sizes"])
            offset = ",".join(str(o) for o in shard["offsets"])
            lines.append(
                f"  {shard['table']:<12} {shard['sharding_type']:<17} {shard['compute_kernel']:<17} "
                f"{shard.get('precision', 'fp32'):<4} "
                f"{size:>14} @ {offset:<10} HBM {_gib(shard['hbm_bytes'])}  host {_gib(shard['ddr_bytes'])}  "
                f"{shard['total_ms']:.4f} ms"
            )
    return "\n".join(lines) + "\n"


def _table_lines(tables: list[dict[str, Any]], has_estimates: bool) -> list[str]:
    """Per table: kernel, precision, cache load factor and (planned here) the estimated HBM and host memory."""
    if not tables:
        return []
    header = ("table", "kernel", "precision", "cache load factor", "HBM", "host memory")
    rows = [header] + [
        (
            t["table"], t["compute_kernel"], t["precision"] or "-",
            "-" if t["cache_load_factor"] is None else f"{t['cache_load_factor']:g}",
            _gib(t["hbm_bytes"]) if has_estimates else "-",
            (_gib(t["ddr_bytes"]) + (" (spilled)" if t["in_host_memory"] else "")) if has_estimates else "-",
        )  # fmt: skip
        for t in tables
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    return ["Tables (the planner's estimates, all shards):", *lines, ""]


def _budget_lines(budget: dict[str, Any] | None) -> list[str]:
    if not budget:
        return []
    memory = "HBM" if budget["memory"] == "hbm" else "host memory"
    return [
        f"{memory} per device: {_gib(budget['capacity_bytes'])}; for the tables {_gib(budget['tables_bytes'])}; kept back "
        f"{_gib(budget['fraction_bytes'])} (hbm_reserved_fraction), {_gib(budget['dense_bytes'])} (dense part in "
        f"training), {_gib(budget['inputs_bytes'])} (pipeline inputs), {_gib(budget['extra_bytes'])} (hbm_reserved_bytes)"
    ]


def write_plan_report(report: dict[str, Any], folder: Path) -> Path:
    """Writes ``sharding_plan.json`` and ``sharding_plan.txt`` into ``folder``; returns the JSON file."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / REPORT_TEXT).write_text(format_report(report))
    path = folder / REPORT_JSON
    path.write_text(json.dumps(report, indent=1) + "\n")
    return path


def read_plan(report: dict[str, Any] | Path) -> ShardingPlan:
    """The ShardingPlan stored in a report (the dict, or the path of ``sharding_plan.json``)."""
    data = json.loads(Path(report).read_text()) if isinstance(report, Path) else report
    return plan_from_json(data["plan"])


def report_holds_plan(folder: Path, plan: ShardingPlan) -> bool:
    """Whether ``folder`` already has a report of exactly ``plan`` (an unreadable one does not count)."""
    try:
        return read_plan(folder / REPORT_JSON) == plan
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.3f} GiB"
