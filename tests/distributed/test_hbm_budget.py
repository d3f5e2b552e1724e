"""What the planner may fill on a GPU, planned here on CPU for GPU presets: the memory it keeps back for
everything but the tables (exact figures for a given module and batch), the warning and report lines when
it puts tables in host memory through UVM kernels, and the precisions refused before any worker starts."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from app.distributed.plan_report import format_report, plan_report
from app.distributed.hbm_budget import dense_training_bytes, memory_budget
from app.distributed.sharding import build_topology, default_sharders, host_memory_warning, plan_on_this_process
from app.distributed.topology import GIB, PRESETS, resolve_topology
from tests.cli.test_cli import test_bad_settings_stop_before_any_worker_with_one_line as refused_before_launch


@pytest.fixture(autouse=True)
def quiet_planner():
    logging.disable(logging.WARNING)  # the planner's stats table; these tests read the objects
    yield
    logging.disable(logging.NOTSET)


class TinyDLRM(nn.Module):
    """A dense layer on the CPU and two tables on the meta device, as the app plans them."""

    def __init__(self, rows: int, dim: int) -> None:
        super().__init__()
        self.dense = nn.Linear(13, 8)  # 13 x 8 weights + 8 biases, float32: 448 bytes
        self.register_buffer("scale", torch.ones(4))  # 16 bytes
        configs = [EmbeddingBagConfig(name=f"t_{i}", embedding_dim=dim, num_embeddings=rows, feature_names=[f"f_{i}"]) for i in range(2)]
        self.tables = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))


def test_the_reservation_counts_the_dense_part_the_pipeline_inputs_and_the_settings_exactly():
    module = TinyDLRM(rows=1_000, dim=16)
    sharders = default_sharders()
    assert dense_training_bytes(module, sharders) == 6 * 448 + 16  # TorchRec's 6x the dense parameters
    topology = build_topology(PRESETS["h100"], world_size=2, local_world_size=2)
    budget = memory_budget(topology, module, sharders, {}, 512, hbm_reserved_fraction=0.15, hbm_reserved_bytes=GIB)
    assert budget.memory == "hbm" and budget.capacity_bytes == 80 * GIB
    assert budget.fraction_bytes == 80 * GIB - int(0.85 * 80 * GIB)
    assert budget.dense_bytes == 2_704
    assert budget.inputs_bytes == 20 * 8 * 512 * 2  # TorchRec: 2 batches x 10 copies of 8-byte ids, 2 tables
    assert budget.extra_bytes == GIB
    assert budget.tables_bytes == int(0.85 * 80 * GIB) - 2_704 - 163_840 - GIB
    # On CPU the fraction and the GPU extra do not apply; the rest comes out of host memory.
    cpu = memory_budget(build_topology(PRESETS["cpu"], world_size=2, local_world_size=2), module, sharders, {}, 512,
                        hbm_reserved_fraction=0.15, hbm_reserved_bytes=GIB)  # fmt: skip
    assert (cpu.memory, cpu.fraction_bytes, cpu.extra_bytes) == ("ddr", 0, 0)
    assert cpu.tables_bytes == 128 * GIB - 2_704 - 163_840


def test_reservation_settings_are_checked_and_typed():
    cpu = torch.device("cpu")
    resolved = resolve_topology("cpu", {"hbm_reserved_fraction": 0.3, "hbm_reserved_bytes": 2e9}, cpu)
    assert (resolved.hbm_reserved_fraction, resolved.hbm_reserved_bytes) == (0.3, 2_000_000_000)
    with pytest.raises(ValueError, match=r"topology_overrides.hbm_reserved_fraction = 1.5: expected a share of HBM below 1"):
        resolve_topology("cpu", {"hbm_reserved_fraction": 1.5}, cpu)
    overridden = resolve_topology("cpu", {"hbm_cap_bytes": 10}, cpu)
    assert overridden.hbm_cap_source == "topology_overrides.hbm_cap_bytes"


# Four 80M x 128 float32 tables: 38.16 GiB each with their row-wise Adagrad state, 152.6 GiB in all,
# against 2 H100s that leave 68 GiB each to the tables.
TOO_BIG_FOR_HBM = [(f"big_{i}", 80_000_000, 128) for i in range(4)]


def big_tables() -> EmbeddingBagCollection:
    configs = [EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=r, feature_names=[f"f_{n}"]) for n, r, d in TOO_BIG_FOR_HBM]
    return EmbeddingBagCollection(tables=configs, device=torch.device("meta"))


def test_tables_that_do_not_fit_in_hbm_are_put_in_host_memory_and_said_so():
    topology = build_topology(PRESETS["h100"], world_size=2, local_world_size=2)
    planned = plan_on_this_process(
        big_tables(), topology=topology, sharders=default_sharders(), constraints={}, batch_size_per_rank=8192
    )
    kernels = {e.table: e.compute_kernel for e in planned.estimates}
    in_host_memory = sorted(name for name, kernel in kernels.items() if "uvm" in kernel)
    assert in_host_memory, f"expected a UVM kernel for some table: {kernels}"
    warning = host_memory_warning(planned)
    assert warning is not None and f"{len(in_host_memory)} table(s) live in host memory" in warning
    assert all(name in warning for name in in_host_memory)
    assert "GiB of host memory" in warning and "compute_kernels: [fused]" in warning

    report = json.loads(json.dumps(plan_report(
        planned, device=PRESETS["h100"], world_size=2, local_world_size=2, objective="performance", source="the planner"
    )))  # fmt: skip
    assert sorted(report["host_memory_tables"]) == in_host_memory
    assert report["memory_budget"]["tables_bytes"] < 80 * GIB
    text = format_report(report)
    assert "WARNING: sharding plan:" in text
    assert all(kernels[name] in text for name in in_host_memory)


def test_the_memory_objective_prefers_host_memory_even_when_hbm_suffices():
    module = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name="small", embedding_dim=64, num_embeddings=100_000, feature_names=["f"])],
        device=torch.device("meta"),
    )
    topology = build_topology(PRESETS["h100"], world_size=2, local_world_size=2)
    planned = plan_on_this_process(
        module, topology=topology, sharders=default_sharders(), constraints={}, batch_size_per_rank=8192,
        objective="memory",
    )  # fmt: skip
    assert {e.compute_kernel for e in planned.estimates} == {"fused_uvm"}
    assert "small (fused_uvm" in host_memory_warning(planned)
    fast = plan_on_this_process(
        module, topology=topology, sharders=default_sharders(), constraints={}, batch_size_per_rank=8192
    )
    assert host_memory_warning(fast) is None


@pytest.mark.parametrize("precision", ["bf16-true", "64-true", "16-true", "transformer-engine"])
def test_precisions_the_app_does_not_apply_are_refused_before_any_worker(precision, sample_dir, capsys):
    if precision == "transformer-engine":
        pytest.importorskip("transformer_engine", reason="Lightning builds this precision only with transformer_engine")
    message = (
        f"trainer.precision = {precision}: fp16 loss scaling" if precision.startswith("16")
        else f"trainer.precision = {precision}: not applied to a TorchRec-sharded model"
    )  # fmt: skip
    refused_before_launch(["--trainer.precision", precision], message, sample_dir, capsys)
