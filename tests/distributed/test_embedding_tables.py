"""FP16 tables and tables larger than HBM, planned here on CPU for GPU presets: fp16 halves the planner's
estimate for a table's weights, tables that do not fit in HBM get FBGEMM's UVM caching kernel and the
warning and the plan report say so, ``cache_load_factor`` reaches the plan, and the settings that a CPU
cannot honour are refused by name before any work starts."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
from fbgemm_gpu.split_table_batched_embeddings_ops_training import ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen
from torchrec.types import DataType

from app.checkpoint.plan_json import plan_from_json, plan_to_json
from app.distributed.plan_report import format_report, plan_report, read_plan
from app.distributed.sharding import (
    PlannedSharding,
    TableConstraint,
    build_constraints,
    build_topology,
    default_sharders,
    host_memory_warning,
    plan_on_this_process,
    validate_sharding_request,
)
from app.distributed.topology import PRESETS
from app.model.dlrm import build_dlrm, build_dlrm_arguments, build_embedding_bag_collection, check_embedding_precision
from app.train.optimizers import fuse_sparse_optimizer
from tests.cli.test_cli import test_bad_settings_stop_before_any_worker_with_one_line as refused_before_launch

BATCH_SIZE_PER_RANK = 8192


@pytest.fixture(autouse=True)
def quiet_planner():
    logging.disable(logging.WARNING)  # the planner's stats table; these tests read the objects
    yield
    logging.disable(logging.NOTSET)


def plan(preset: str, rows: list[int], precision: str = "fp32", constraints: dict | None = None) -> PlannedSharding:
    """The app's tables (dimension 128, row-wise Adagrad fused as the app fuses it) planned for 2 GPUs of ``preset``."""
    tables = build_embedding_bag_collection(128, rows, "meta", precision)
    fuse_sparse_optimizer(tables.parameters(), "row_wise_adagrad", 0.01)
    names = [config.name for config in tables.embedding_bag_configs()]
    return plan_on_this_process(
        tables, topology=build_topology(PRESETS[preset], world_size=2, local_world_size=2), sharders=default_sharders(),
        constraints=build_constraints(names, None, constraints or {}), batch_size_per_rank=BATCH_SIZE_PER_RANK,
    )  # fmt: skip


def report_of(planned: PlannedSharding, preset: str) -> dict:
    report = plan_report(
        planned, device=PRESETS[preset], world_size=2, local_world_size=2, objective="performance", source="the planner"
    )
    return json.loads(json.dumps(report))  # as written to sharding_plan.json


WHOLE_IN_HBM = TableConstraint(sharding_types=["table_wise"], compute_kernels=["fused"])


@pytest.mark.parametrize("preset", ["h100", "mi300x"])
def test_fp16_tables_halve_the_planners_estimate_of_their_weights_and_optimizer_state(preset):
    # One 1M x 128 table per GPU, whole and in HBM. The planner counts the weights (rows x 128 x 4 or 2
    # bytes), the row-wise Adagrad state (1/128 of the weights, by its heuristic), the ids of a batch from
    # every rank (8192 x 2 x 8 bytes: int64 whatever the precision) and the pooled outputs (8192 x 2 x 128
    # in the tables' element size).
    constraints = {"t_cat_0": WHOLE_IN_HBM, "t_cat_1": WHOLE_IN_HBM}
    fp32, fp16 = (plan(preset, [1_000_000] * 2, precision, constraints) for precision in ("fp32", "fp16"))
    ids = 8192 * 2 * 8
    assert [e.hbm_bytes for e in fp32.estimates] == [512_000_000 + 4_000_000 + ids + 8192 * 2 * 128 * 4] * 2
    assert [e.hbm_bytes for e in fp16.estimates] == [256_000_000 + 2_000_000 + ids + 8192 * 2 * 128 * 2] * 2
    assert [e.hbm_bytes for e in fp16.estimates] == [262_325_376, 262_325_376]
    assert {(e.precision, e.ddr_bytes, e.cache_load_factor) for e in fp16.estimates} == {("fp16", 0, None)}
    tables = report_of(fp16, preset)["tables"]
    assert [(t["table"], t["compute_kernel"], t["precision"], t["hbm_bytes"]) for t in tables] == [
        ("t_cat_0", "fused", "fp16", 262_325_376),
        ("t_cat_1", "fused", "fp16", 262_325_376),
    ]


# 80M x 128 rows: 40.96 GB of fp32 weights and 0.32 GB of row-wise Adagrad state a table. Four of them do
# not fit in the 2 x 68 GiB two H100s leave to the tables, ten do not fit in two MI300Xs' 2 x 163 GiB.
SPILLING_MODELS = [("h100", 4), ("mi300x", 10)]


@pytest.mark.parametrize("preset, num_tables", SPILLING_MODELS)
def test_tables_that_do_not_fit_in_hbm_get_the_uvm_caching_kernel_and_the_report_says_so(preset, num_tables):
    planned = plan(preset, [80_000_000] * num_tables)
    kernels = {e.table: e.compute_kernel for e in planned.estimates}
    spilled = {"t_cat_0": "fused_uvm_caching", "t_cat_1": "fused_uvm_caching"}
    assert kernels == {**{f"t_cat_{i}": "fused" for i in range(2, num_tables)}, **spilled}  # the rest split row-wise

    warning = host_memory_warning(planned)
    assert warning.startswith("sharding plan: 2 table(s) live in host memory, read by the GPU over PCIe through UVM: ")
    assert "t_cat_0 (fused_uvm_caching, an HBM cache of 0.2 of its rows, 38.44 GiB of host memory)" in warning
    assert "model.embedding_precision = fp16" in warning

    report = report_of(planned, preset)
    assert report["host_memory_tables"] == spilled
    caching = [t for t in report["tables"] if t["in_host_memory"]]
    # Host memory: the weights and the optimizer state. HBM: a cache of 0.2 of the rows (with its share of the
    # optimizer state, by TorchRec's heuristic), the cache's own state (4 + 0.2 x 16 bytes a row) and the batch.
    assert [(t["table"], t["cache_load_factor"], t["precision"], t["ddr_bytes"]) for t in caching] == [
        ("t_cat_0", 0.2, "fp32", 41_280_000_000),
        ("t_cat_1", 0.2, "fp32", 41_280_000_000),
    ]
    batch_bytes = 8192 * 2 * 8 + 8192 * 2 * 128 * 4
    assert all(t["hbm_bytes"] == 8_192_000_000 + 64_000_000 + 576_000_000 + batch_bytes for t in caching)
    text = format_report(report)
    assert "WARNING: sharding plan: 2 table(s) live in host memory" in text
    assert "t_cat_0  fused_uvm_caching  fp32       0.2                8.233 GiB   38.445 GiB (spilled)" in text

    # The same tables in fp16 fit in HBM: every table keeps the fused kernel and nothing is said.
    halved = plan(preset, [80_000_000] * num_tables, "fp16")
    assert {e.compute_kernel for e in halved.estimates} == {"fused"}
    assert host_memory_warning(halved) is None and report_of(halved, preset)["host_memory_tables"] == {}


def test_cache_load_factor_reaches_the_plan_the_estimates_and_the_report():
    constraints = {
        "t_cat_0": TableConstraint(
            sharding_types=["table_wise"], compute_kernels=["fused_uvm_caching"], cache_load_factor=0.5
        )
    }
    planned = plan("h100", [1_000_000] * 2, constraints=constraints)
    sharding = planned.plan.plan[""]["t_cat_0"]
    assert (sharding.compute_kernel, sharding.cache_params.load_factor) == ("fused_uvm_caching", 0.5)
    assert planned.plan.plan[""]["t_cat_1"].cache_params is None
    (cached,) = [e for e in planned.estimates if e.table == "t_cat_0"]
    # HBM: half the rows cached (256 MB), their optimizer state (2 MB), the cache's state
    # (1M x (4 + 0.5 x 16) bytes) and the batch; host memory: the whole table and its optimizer state.
    assert (cached.cache_load_factor, cached.hbm_bytes, cached.ddr_bytes) == (
        0.5, 256_000_000 + 2_000_000 + 12_000_000 + 8_519_680, 516_000_000
    )  # fmt: skip

    report = report_of(planned, "h100")
    assert read_plan(report) == planned.plan  # the cache parameters survive the report's JSON
    assert plan_from_json(json.loads(json.dumps(plan_to_json(planned.plan)))) == planned.plan
    assert [(t["table"], t["cache_load_factor"], t["hbm_bytes"]) for t in report["tables"]] == [
        ("t_cat_0", 0.5, 278_519_680),
        ("t_cat_1", None, 524_519_680),
    ]
    assert "an HBM cache of 0.5 of its rows" in report["host_memory_warning"]
    # A plan read back from a checkpoint has no estimates; its report still shows the kernel and the factor.
    from_checkpoint = report_of(PlannedSharding(read_plan(report), []), "h100")["tables"]
    assert [(t["compute_kernel"], t["cache_load_factor"], t["precision"]) for t in from_checkpoint] == [
        ("fused_uvm_caching", 0.5, None),
        ("fused", None, None),
    ]


def test_embedding_precision_sets_every_tables_data_type():
    sizes = dict(
        embedding_dim=8, num_embeddings_per_feature=[10] * 26, dense_arch_layer_sizes=[16, 8], over_arch_layer_sizes=[16, 1]
    )
    for precision, data_type, dtype in (("fp32", DataType.FP32, torch.float32), ("fp16", DataType.FP16, torch.float16)):
        model = build_dlrm(**build_dlrm_arguments({"interaction": "dot", "embedding_precision": precision, **sizes}))
        tables = model.sparse_arch.embedding_bag_collection
        assert {c.data_type for c in tables.embedding_bag_configs()} == {data_type}
        assert {p.dtype for p in tables.parameters()} == {dtype}
        assert model.over_arch.model[-1].weight.dtype == torch.float32  # the dense part stays float32
    assert {c.data_type for c in build_embedding_bag_collection(8, [10]).embedding_bag_configs()} == {DataType.FP32}


def test_fbgemm_cpu_kernels_round_fp16_updates_to_nearest_so_small_updates_are_lost():
    # Why check_embedding_precision refuses fp16 on CPU: SGD steps of 1e-4 on weights of 1.0, below half the
    # fp16 spacing under 1.0 (2^-12), never move them although stochastic_rounding is asked for (it is the
    # default); with stochastic rounding they would move by 1e-4 a step on average. If this starts failing,
    # FBGEMM rounds stochastically on CPU and the refusal can go.
    final = {}
    for precision in (SparseType.FP16, SparseType.FP32):
        tables = SplitTableBatchedEmbeddingBagsCodegen(
            [(10, 8, EmbeddingLocation.HOST, ComputeDevice.CPU)], optimizer=EmbOptimType.EXACT_SGD,
            learning_rate=1e-4, weights_precision=precision, stochastic_rounding=True,
        )  # fmt: skip
        tables.split_embedding_weights()[0].fill_(1.0)
        for _ in range(100):
            tables(torch.arange(10), torch.arange(11)).sum().backward()  # a gradient of 1 for every weight
        final[precision] = tables.split_embedding_weights()[0].float()
    assert torch.equal(final[SparseType.FP16], torch.ones(10, 8))
    assert torch.allclose(final[SparseType.FP32], torch.full((10, 8), 0.99), atol=1e-5)


def test_fp16_tables_are_refused_on_cpu_and_unknown_precisions_everywhere():
    check_embedding_precision("fp16", "cuda")
    check_embedding_precision("fp32", "cpu")
    with pytest.raises(ValueError, match=r"^model.embedding_precision = fp16: FBGEMM's CPU embedding kernels round fp16"):
        check_embedding_precision("fp16", "cpu")
    with pytest.raises(ValueError, match=r"^model.embedding_precision = 'bf16' is not one of fp32, fp16$"):
        check_embedding_precision("bf16", "cuda")
    with pytest.raises(ValueError, match=r"^model.embedding_precision = 'fp8' is not one of fp32, fp16$"):
        build_embedding_bag_collection(8, [10], embedding_precision="fp8")


@pytest.mark.parametrize(
    "constraint, device_type, message",
    [
        (TableConstraint(compute_kernels=["fused_uvm_caching"]), "cpu",
         "strategy.table_constraints.t_cat_3.compute_kernels: 'fused_uvm_caching' is not available on cpu (TorchRec "
         "offers dense, fused there); tables in host memory (fused_uvm, fused_uvm_caching) need GPUs"),
        (TableConstraint(compute_kernels=["fused_uvm"]), "cpu",
         "strategy.table_constraints.t_cat_3.compute_kernels: 'fused_uvm' is not available on cpu"),
        (TableConstraint(compute_kernels=["fused_hbm"]), "cuda",
         "strategy.table_constraints.t_cat_3.compute_kernels: unknown kernel 'fused_hbm'; known: dense, fused, fused_uvm"),
        (TableConstraint(cache_load_factor=0.5), "cpu",
         "strategy.table_constraints.t_cat_3.cache_load_factor = 0.5: the UVM caching kernel (fused_uvm_caching) it "
         "sizes is not available on cpu"),
        (TableConstraint(cache_load_factor=0.0), "cuda",
         "strategy.table_constraints.t_cat_3.cache_load_factor = 0.0: expected the share of the table's rows cached in "
         "HBM, in (0, 1]"),
        (TableConstraint(cache_load_factor=1.5), "cuda",
         "strategy.table_constraints.t_cat_3.cache_load_factor = 1.5: expected"),
        (TableConstraint(compute_kernels=["fused"], cache_load_factor=0.5), "cuda",
         "strategy.table_constraints.t_cat_3.cache_load_factor = 0.5: applies to the fused_uvm_caching kernel only, "
         "which strategy.table_constraints.t_cat_3.compute_kernels = ['fused'] leaves out"),
    ],
)  # fmt: skip
def test_kernels_and_cache_settings_a_device_cannot_honour_are_refused_by_name(constraint, device_type, message):
    with pytest.raises(ValueError) as error:
        validate_sharding_request(None, {"t_cat_3": constraint}, device_type)
    assert str(error.value).startswith(message)


def test_uvm_settings_for_gpus_pass_the_checks():
    for constraint in (TableConstraint(compute_kernels=["fused", "fused_uvm_caching"], cache_load_factor=1.0),
                       TableConstraint(cache_load_factor=0.05), TableConstraint(compute_kernels=["fused_uvm"])):  # fmt: skip
        validate_sharding_request(None, {"t_cat_3": constraint}, "cuda")


@pytest.mark.parametrize(
    "table_constraints, message",
    [
        ("{t_cat_0: {compute_kernels: [fused_uvm_caching]}}",
         "strategy.table_constraints.t_cat_0.compute_kernels: 'fused_uvm_caching' is not available on cpu"),
        ("{t_cat_0: {cache_load_factor: 0.5}}",
         "strategy.table_constraints.t_cat_0.cache_load_factor = 0.5: the UVM caching kernel"),
    ],
)  # fmt: skip
def test_uvm_settings_on_cpu_are_refused_before_any_worker(table_constraints, message, sample_dir, capsys):
    refused_before_launch(["--trainer.strategy.table_constraints", table_constraints], message, sample_dir, capsys)
