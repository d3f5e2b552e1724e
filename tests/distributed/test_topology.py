"""Hardware presets drive TorchRec's planner: plans differ with the device, `auto` finds the preset by name,
overrides win, a model that cannot fit names the table, and the plan written at start-up is the plan used."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections import Counter

import pytest
import torch
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from app.distributed.plan_report import REPORT_TEXT, read_plan
from app.distributed.sharding import build_topology, default_sharders, plan_on_this_process
from app.distributed.topology import GIB, PRESETS, TOPOLOGY_CHOICES, preset_for_device_name, resolve_topology
from tests.multiprocess import run_on_ranks
from tests.distributed.test_sharding import fit_args
from tests.cli.test_train import run_app

WORLD_SIZE = 4


@pytest.fixture(autouse=True)
def quiet_planner():
    # The planner's stats table is long; these tests read the plan objects, not the log.
    logging.disable(logging.INFO)
    yield
    logging.disable(logging.NOTSET)


def tables(*sizes: tuple[str, int, int]) -> EmbeddingBagCollection:
    """An EmbeddingBagCollection on the meta device (no memory): planning needs only the shapes."""
    configs = [EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=r, feature_names=[f"f_{n}"]) for n, r, d in sizes]
    return EmbeddingBagCollection(tables=configs, device=torch.device("meta"))


def plan_types(module, device, objective="performance", batch_size_per_rank=8192, constraints=None) -> dict:
    topology = build_topology(device, world_size=WORLD_SIZE, local_world_size=WORLD_SIZE)
    planned = plan_on_this_process(
        module, topology=topology, sharders=default_sharders(), constraints=constraints or {},
        batch_size_per_rank=batch_size_per_rank, objective=objective,
    )  # fmt: skip
    return planned, {name: s.sharding_type for plan in planned.plan.plan.values() for name, s in plan.items()}


# Two 41 GB tables (80M rows x 128 float32) and four small ones: an MI300X holds a big table whole,
# a 32 GB device cannot.
BIG_AND_SMALL = [("big_0", 80_000_000, 128), ("big_1", 80_000_000, 128)] + [(f"small_{i}", 100_000, 64) for i in range(4)]


def test_mi300x_keeps_big_tables_whole_where_a_32_gb_device_must_split_them():
    module = tables(*BIG_AND_SMALL)
    mi300x = PRESETS["mi300x"]
    _, on_mi300x = plan_types(module, mi300x)
    _, on_32_gb = plan_types(module, dataclasses.replace(mi300x, hbm_cap_bytes=32 * GIB))

    assert on_mi300x == {name: "table_wise" for name, _, _ in BIG_AND_SMALL}
    assert {on_32_gb["big_0"], on_32_gb["big_1"]} == {"row_wise"}
    assert [on_32_gb[f"small_{i}"] for i in range(4)] == ["table_wise"] * 4


def test_the_estimates_cover_every_shard_and_the_memory_objective_lowers_peak_hbm():
    module = tables(*BIG_AND_SMALL)
    fast, _ = plan_types(module, PRESETS["mi300x"], "performance")
    small, _ = plan_types(module, PRESETS["mi300x"], "memory")
    for planned in (fast, small):
        shards = Counter(e.table for e in planned.estimates)
        assert set(shards) == {name for name, _, _ in BIG_AND_SMALL}
        assert all(e.hbm_bytes > 0 and e.total_ms > 0 and 0 <= e.rank < WORLD_SIZE for e in planned.estimates)

    def peak_hbm(planned):
        return max(sum(e.hbm_bytes for e in planned.estimates if e.rank == r) for r in range(WORLD_SIZE))

    # A whole 41 GB table (plus its optimizer state) on one device against the same split over four.
    assert peak_hbm(small) < peak_hbm(fast) * 0.5


def test_a_table_that_fits_nowhere_is_named_with_its_shortfall():
    module = tables(("huge", 80_000_000, 128), ("tiny", 1_000, 8))
    cpu_1_gb = dataclasses.replace(PRESETS["cpu"], ddr_cap_bytes=1 * GIB)
    with pytest.raises(ValueError) as error:
        plan_types(module, cpu_1_gb, constraints=None)
    message = str(error.value)
    assert "1 table(s) fit on no device" in message
    assert "huge: short by" in message and "tiny" not in message


def test_a_table_too_big_for_one_gpu_is_named_even_when_all_gpus_together_could_hold_it():
    module = tables(("t_big", 80_000_000, 128), ("t_small", 1_000, 128))
    only_whole = {"t_big": ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused"])}
    with pytest.raises(ValueError) as error:
        plan_types(module, dataclasses.replace(PRESETS["h100"], hbm_cap_bytes=32 * GIB), constraints=only_whole)
    # 80M x 128 float32 rows and their row-wise optimizer state: 38.16 GiB, against 85% of 32 GiB less
    # TorchRec's reservation for the pipeline's sparse inputs (20 x 8 bytes x 8192 rows x 2 tables).
    assert "1 table(s) fit on no device" in str(error.value)
    assert "t_big: short by 10.97 GiB per device" in str(error.value)


@pytest.mark.parametrize(
    "device_name, preset",
    [
        ("AMD Instinct MI300X", "mi300x"),
        ("AMD Instinct MI300X VF", "mi300x"),
        ("AMD Instinct MI325X", "mi325x"),
        ("AMD Instinct MI355X", "mi355x"),
        ("AMD Instinct MI350X", "mi355x"),
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H100 PCIe", "h100"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA B200", "b200"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("NVIDIA GeForce RTX 4090", None),
        ("AMD Instinct MI250X", None),
    ],
)
def test_auto_maps_device_names_to_presets(device_name, preset):
    assert preset_for_device_name(device_name) == preset


def test_overrides_win_and_bad_settings_name_the_setting():
    cpu = torch.device("cpu")
    assert resolve_topology("auto", None, cpu) == PRESETS["cpu"]
    resolved = resolve_topology("cpu", {"ddr_cap_bytes": 2e9, "inter_node_bw_gb_per_s": 100}, cpu)
    assert (resolved.ddr_cap_bytes, resolved.inter_node_bw_gb_per_s) == (2_000_000_000, 100.0)
    assert resolved.intra_node_bw_gb_per_s == PRESETS["cpu"].intra_node_bw_gb_per_s
    topology = build_topology(resolved, world_size=2, local_world_size=1)
    assert [d.storage.ddr for d in topology.devices] == [2_000_000_000] * 2
    assert topology.local_world_size == 1  # from the launch, never from the preset

    with pytest.raises(ValueError, match=r"strategy.topology = 'mi400' is not a preset; choose one of auto, cpu, mi300x"):
        resolve_topology("mi400", None, cpu)
    with pytest.raises(ValueError, match=r"topology_overrides: unknown field\(s\) hbm_gb; valid fields are hbm_cap_bytes"):
        resolve_topology("cpu", {"hbm_gb": 1}, cpu)
    with pytest.raises(ValueError, match=r"strategy.topology = 'mi300x' describes cuda devices but this run uses cpu"):
        resolve_topology("mi300x", None, cpu)
    assert set(TOPOLOGY_CHOICES) - set(PRESETS) == {"auto"}


def plan_used(cli) -> dict:
    return {"plan": cli.trainer.strategy.sharding_plan}


def test_the_plan_written_at_start_up_is_the_plan_used(sample, tmp_path):
    args = fit_args(sample, tmp_path, "table_wise", 64) + ["--trainer.max_epochs", "1"]

    ranks = run_on_ranks(2, args, tmp_path, plan_used)
    report_path = tmp_path / "sharding_plan.json"
    assert read_plan(report_path) == ranks[0]["plan"] == ranks[1]["plan"]
    report = json.loads(report_path.read_text())
    assert report["topology"]["name"] == "cpu" and report["world_size"] == 2 and report["has_estimates"]
    assert sorted(len(r["shards"]) for r in report["ranks"]) == [13, 13]
    assert all(r["ddr_bytes"] > 0 and r["estimated_ms_per_step"] > 0 for r in report["ranks"])
    text = (tmp_path / REPORT_TEXT).read_text()
    assert "rank 1: 13 shards" in text and "t_cat_25" in text


def test_a_model_too_big_for_the_devices_stops_every_rank_before_training(sample, tmp_path):
    result = run_app(
        *fit_args(sample, tmp_path, "table_wise", 64)[:-1],  # without the test-only callback
        "--trainer.strategy.topology_overrides", "{ddr_cap_bytes: 1000}",
        "--trainer.devices", "2",
    )  # fmt: skip
    assert result.returncode != 0
    assert "the model does not fit: 26 table(s) fit on no device" in result.stderr
    assert "t_cat_0: short by" in result.stderr
    assert "Epoch 0" not in result.stdout + result.stderr
