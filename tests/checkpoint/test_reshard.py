"""Checkpoints load under another world size and another sharding plan (app/checkpoint/reshard.py).

One 2-process writer run (tests/reshard_runs.py: t_cat_0 data-parallel, t_cat_1 split into two
column shards, the rest table-wise) leaves a mid-epoch and a final checkpoint; readers on 1, 2 and
3 processes under other plans reuse them:

    writer, 2 ranks, step 8  -> fit on 1 rank (2->1; t_cat_0 DP -> TW, t_cat_2 TW -> DP, both column
                                shards of t_cat_1 on rank 0), compared with the writer's own end
                    step 16 -> validate on 3 ranks (2->3; t_cat_1's column shards merge, t_cat_4 -> DP)
    that 1-rank fit, step 16 -> validate on 2 ranks (1->2; t_cat_2 DP -> two column shards, t_cat_3 -> DP)

Resumed training is compared with the never-interrupted writer. The global batches are the same
(96 rows per step on any world size) and every table keeps its optimizer semantics under the new
plan (row-wise Adagrad over the same columns), so the only difference is the order in which float
sums are taken (a gradient summed over ranks vs over one batch): the same 2e-5 that separates 1 and
2 ranks in test_sharding. A lost optimizer state would not pass: restarting Adagrad's accumulator
moves the predictions by ~2e-2 (checked by disabling it). A table whose column layout changes
trains differently afterwards (one accumulator per row and shard), so such tables are compared on
loading (validate), not on training.
"""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards

from app.checkpoint.reshard import (
    RowwiseTarget,
    SliceLoadPlanner,
    TableLayout,
    column_weighted_mean,
    load_rowwise,
    refuse_adam_across_data_parallel,
    rowwise_targets,
)
from app.data.dataset import CriteoBatches
from app.data.loader import ResumableBatchLoader
from app.train.fused_step_count import training_kernels
from app.data.tsv import CriteoArrays
from tests.reshard_runs import SPLIT_TABLE, WRITER_PLAN, eval_args, fit_with_checkpoints, plan_args, table_key
from tests.multiprocess import run_on_ranks
from tests.distributed.test_sharding import shards_and_predictions

TOLERANCE_ACROSS_WORLD_SIZES = 2e-5


# t_cat_0 leaves data_parallel, t_cat_2 joins it; SPLIT_TABLE keeps its two column shards, both on rank 0.
ONE_RANK_PLAN = {SPLIT_TABLE: {"sharding_types": ["column_wise"], "min_partition": 4},
                 "t_cat_2": {"sharding_types": ["data_parallel"]}}  # fmt: skip


@pytest.fixture(scope="module")
def resumed_on_one_rank(checkpoint_writer, sample, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("one_rank")
    step8 = str(checkpoint_writer["root"] / "checkpoints" / "step=8.ckpt")
    (result,) = run_on_ranks(
        1, fit_with_checkpoints(sample, root, 1, plan_args("table_wise", ONE_RANK_PLAN), ["--ckpt_path", step8]), root, shards_and_predictions
    )
    return {"root": root, "result": result}


def test_fit_resumed_on_one_rank_continues_the_two_rank_run(checkpoint_writer, resumed_on_one_rank):
    resumed, uninterrupted = resumed_on_one_rank["result"], checkpoint_writer["result"]
    assert resumed["global_step"] == uninterrupted["global_step"] == 16
    assert resumed["shards"][table_key(SPLIT_TABLE)] == [((0, 0), (500, 4)), ((0, 4), (500, 4))]
    assert resumed["shards"][table_key("t_cat_0")] == [((0, 0), (500, 8))]
    assert resumed["shards"][table_key("t_cat_2")] == [((0, 0), (500, 8))]
    np.testing.assert_allclose(
        resumed["probabilities"], uninterrupted["probabilities"], rtol=0, atol=TOLERANCE_ACROSS_WORLD_SIZES
    )


def _loaded_accumulators(cli) -> dict:
    (probe,) = [c for c in cli.trainer.callbacks if type(c).__name__ == "LoadedAccumulators"]
    return {"accumulators": probe.accumulators}


def _saved_tensor(checkpoint, key: str) -> torch.Tensor:
    """The whole tensor saved under ``key`` (optimizer_states.0.state.<key>), read on this process."""
    saved_key = f"optimizer_states.0.state.{key}"
    metadata = dcp.FileSystemReader(checkpoint).read_metadata().state_dict_metadata[saved_key]
    tensor = {saved_key: torch.empty(metadata.size, dtype=metadata.properties.dtype)}
    dcp.load(tensor, checkpoint_id=checkpoint, no_dist=True)
    return tensor[saved_key]


def test_resumed_under_another_plan_each_tables_row_wise_adagrad_state_is_loaded_merged_or_split(checkpoint_writer, sample, tmp_path):
    # The writer's step-8 state loaded under a plan that changes four tables' layouts, read back as
    # training starts (before any step): t_cat_0 data_parallel -> table-wise, SPLIT_TABLE's two column
    # shards -> one table-wise shard (merged), t_cat_2 table-wise -> two column shards (split),
    # t_cat_3 table-wise -> data_parallel.
    step8 = checkpoint_writer["root"] / "checkpoints" / "step=8.ckpt"
    plan = plan_args("table_wise", {"t_cat_2": {"sharding_types": ["column_wise"], "min_partition": 4},
                                    "t_cat_3": {"sharding_types": ["data_parallel"]}})  # fmt: skip
    extra = ["--ckpt_path", str(step8), "--trainer.max_steps", "9", "--trainer.callbacks+=tests.checkpoint.optimizer_state_probe.LoadedAccumulators"]
    ranks = run_on_ranks(2, fit_with_checkpoints(sample, tmp_path, 2, plan, extra), tmp_path, _loaded_accumulators)

    fused = "sparse.model.sparse_arch.embedding_bag_collection.embedding_bags.{0}.weight.{0}.momentum1"
    replicated = "dense.replicated_tables.model.sparse_arch.embedding_bag_collection.embedding_bags.{0}.weight.sum"
    saved = {
        "t_cat_0": _saved_tensor(step8, replicated.format("t_cat_0")),  # (500, 1)
        SPLIT_TABLE: _saved_tensor(step8, fused.format(SPLIT_TABLE)),  # (1000,): columns 0-3's rows, then 4-7's
        "t_cat_2": _saved_tensor(step8, fused.format("t_cat_2")),
        "t_cat_3": _saved_tensor(step8, fused.format("t_cat_3")),
    }
    assert saved["t_cat_0"].shape == (500, 1) and saved[SPLIT_TABLE].shape == (1000,)
    left, right = saved[SPLIT_TABLE].double().split(500)
    expected = {
        "t_cat_0": (fused.format("t_cat_0"), saved["t_cat_0"].reshape(500)),
        # Each row's mean over all 8 columns: the mean of the two 4-column shards' accumulators.
        SPLIT_TABLE: (fused.format(SPLIT_TABLE), ((left + right) / 2).float()),
        # Each 4-column shard starts from the whole row's accumulator: both stacked, (1000,).
        "t_cat_2": (fused.format("t_cat_2"), saved["t_cat_2"].repeat(2)),
        "t_cat_3": (replicated.format("t_cat_3"), saved["t_cat_3"].reshape(500, 1)),
    }
    for table, (key, values) in expected.items():
        pieces = [(rank, piece) for rank, r in enumerate(ranks) if table in r["accumulators"] for piece in [r["accumulators"][table]]]
        assert {piece[0] for _, piece in pieces} == {key}, table
        held = sorted(((offset, tensor) for _, (_, parts) in pieces for offset, tensor in parts), key=lambda piece: piece[0])
        if table == "t_cat_3":  # a replica on both ranks
            assert len(held) == 2 and all(torch.equal(tensor, values) for _, tensor in held)
            continue
        assert [offset for offset, _ in held] == list(range(0, len(values), 500)), table  # every row once
        for offset, tensor in held:
            assert torch.equal(tensor, values[offset : offset + len(tensor)]), table
    assert not torch.equal(left, right)  # the merge had two different halves to average


def test_validate_on_three_ranks_under_another_plan_scores_as_the_two_rank_writer(checkpoint_writer, sample, tmp_path):
    last = checkpoint_writer["root"] / "checkpoints" / "step=16.ckpt"
    plan = plan_args("table_wise", {"t_cat_4": {"sharding_types": ["data_parallel"]}})
    ranks = run_on_ranks(3, eval_args(sample, tmp_path, "validate", 3, last, plan), tmp_path, shards_and_predictions)
    # SPLIT_TABLE's two column shards merge into one table-wise shard; t_cat_0 leaves data_parallel.
    held = [r["shards"][table_key(SPLIT_TABLE)] for r in ranks]
    assert sorted(held) == [[], [], [((0, 0), (500, 8))]]
    assert sum(len(r["shards"][table_key("t_cat_0")]) for r in ranks) == 1
    assert ranks[0]["shards"][table_key("t_cat_4")] == [((0, 0), (500, 8))]  # now a replica on every rank
    np.testing.assert_allclose(ranks[0]["probabilities"], checkpoint_writer["result"]["probabilities"], rtol=0, atol=1e-6)


def test_validate_on_two_ranks_from_a_one_rank_checkpoint_splits_its_tables(resumed_on_one_rank, sample, tmp_path):
    last = resumed_on_one_rank["root"] / "checkpoints" / "step=16.ckpt"
    plan = plan_args("column_wise", {"t_cat_2": {"min_partition": 4}, "t_cat_3": {"sharding_types": ["data_parallel"]}})
    ranks = run_on_ranks(2, eval_args(sample, tmp_path, "validate", 2, last, plan), tmp_path, shards_and_predictions)
    # Table-wise on one rank -> two column shards on two ranks, and one table replicated.
    assert ranks[0]["shards"][table_key("t_cat_2")] in ([((0, 0), (500, 4))], [((0, 4), (500, 4))])
    assert ranks[0]["shards"][table_key("t_cat_3")] == [((0, 0), (500, 8))]
    np.testing.assert_allclose(ranks[0]["probabilities"], resumed_on_one_rank["result"]["probabilities"], rtol=0, atol=1e-6)


def _rank_loader(rank: int, world_size: int, batch_size_per_rank: int) -> ResumableBatchLoader:
    rows = np.arange(96)  # whole global batches: a short last one would be split differently
    arrays = CriteoArrays(
        dense=np.repeat(rows[:, None], 13, axis=1).astype(np.float32),
        sparse=np.repeat(rows[:, None], 26, axis=1),
        labels=(rows % 2).astype(np.float32),
    )
    batches = CriteoBatches(arrays, batch_size_per_rank, rank, world_size, shuffle=True, seed=1, drop_remainder=True)
    return ResumableBatchLoader(batches)


def test_the_loader_position_carries_over_to_another_world_size_with_the_same_global_batch():
    one_rank = _rank_loader(0, 1, 12)
    one_rank.sampler.set_epoch(2)
    epoch = [b.row_ids.tolist() for b in one_rank]
    interrupted = _rank_loader(0, 1, 12)
    interrupted.sampler.set_epoch(2)
    iterator = iter(interrupted)
    for _ in range(3):
        next(iterator)
    state = interrupted.state_dict()

    rest_per_rank = []
    for rank in range(3):  # 3 ranks x 4 rows = the same global batches of 12
        loader = _rank_loader(rank, 3, 4)
        loader.load_state_dict(state)
        loader.sampler.set_epoch(2)
        rest_per_rank.append([b.row_ids.tolist() for b in loader])
    global_batches = [sum(parts, []) for parts in zip(*rest_per_rank)]
    assert global_batches == epoch[3:]

    with pytest.raises(ValueError, match="set data.batch_size to 6 to resume at the next unseen batch"):
        _rank_loader(0, 2, 5).load_state_dict(state)


def test_slices_of_a_stacked_row_wise_accumulator_load_and_merge_by_column_width(tmp_path):
    # Two column shards (4 + 4 columns) of a 6-row table, their accumulators stacked as under column-wise.
    left, right = torch.arange(6.0), torch.arange(6.0) * 10
    key = "optimizer_states.0.state.sparse.embedding_bags.t.weight.t.momentum1"
    dcp.save({key: torch.cat([left, right])}, checkpoint_id=tmp_path, no_dist=True)
    slices = {"left_rows_2_5": (key, [2]), "right_rows_2_5": (key, [6 + 2])}
    buffers = {name: torch.empty(3) for name in slices}
    dcp.load(buffers, checkpoint_id=tmp_path, planner=SliceLoadPlanner(slices), no_dist=True)
    assert buffers["left_rows_2_5"].tolist() == [2.0, 3.0, 4.0]
    assert buffers["right_rows_2_5"].tolist() == [20.0, 30.0, 40.0]
    # Merged into one 8-column shard: each row's mean of squared gradients over all 8 columns.
    merged = column_weighted_mean([(buffers["left_rows_2_5"], 4), (buffers["right_rows_2_5"], 4)], width=8)
    assert merged.tolist() == [11.0, 16.5, 22.0]
    # A 6-column shard over columns [2, 8): 2 of the left shard's columns, all 4 of the right one's.
    assert column_weighted_mean([(left[:1], 2), (right[1:2], 4)], width=6).tolist() == pytest.approx([(0 * 2 + 10 * 4) / 6])


# ---- row-wise branches (row_wise and table_row_wise are GPU-only here), at the function level ----
# A 6-row, 8-column table "t". FBGEMM keeps one row-wise Adagrad accumulator per row and column
# shard: column shards' vectors stacked (K * rows,), a row-wise table's one vector (rows,) split
# into row ranges across ranks, a data-parallel table's (rows, 1).

ROWWISE_KEY = "optimizer_states.0.state.sparse.embedding_bags.t.weight.t.momentum1"
COLUMN_WISE = TableLayout("column_wise", ((0, 0, 6, 4, 0), (0, 4, 6, 4, 1)))
ROW_WISE = TableLayout("row_wise", ((0, 0, 3, 8, 0), (3, 0, 3, 8, 1)))
MODEL_STATE = {"model.sparse_arch.embedding_bag_collection.embedding_bags.t.weight": torch.empty(6, 8)}


def _load_into(tmp_path, saved: torch.Tensor, saved_layout: TableLayout, targets: list[RowwiseTarget]) -> None:
    dcp.save({ROWWISE_KEY: saved}, checkpoint_id=tmp_path, no_dist=True)
    saved_md = dcp.FileSystemReader(tmp_path).read_metadata().state_dict_metadata[ROWWISE_KEY]
    rowwise = [(ROWWISE_KEY, target, saved_md) for target in targets]
    load_rowwise(tmp_path, lambda: dcp.FileSystemReader(tmp_path), rowwise, {"t": saved_layout}, MODEL_STATE)


def test_row_wise_shards_from_column_shards_get_the_column_mean_of_their_rows(tmp_path):
    left, right = torch.arange(6.0), torch.arange(6.0) * 10
    top, bottom = torch.zeros(3), torch.zeros(3)  # rank 0 holds rows [0, 3), rank 1 rows [3, 6), all 8 columns
    _load_into(tmp_path, torch.cat([left, right]), COLUMN_WISE, [RowwiseTarget(top, 0, 0, 8), RowwiseTarget(bottom, 3, 0, 8)])
    assert top.tolist() == [0.0, 5.5, 11.0]
    assert bottom.tolist() == [16.5, 22.0, 27.5]


def test_row_wise_shards_on_three_ranks_from_two_and_column_shards_from_them_keep_the_values(tmp_path):
    saved = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])  # row-wise on 2 ranks: rows [0, 3) and [3, 6)
    thirds = [torch.zeros(2) for _ in range(3)]
    left, right = torch.zeros(6), torch.zeros(6)  # column-wise: each column shard's whole vector
    targets = [RowwiseTarget(t, 2 * i, 0, 8) for i, t in enumerate(thirds)]
    targets += [RowwiseTarget(left, 0, 0, 4), RowwiseTarget(right, 0, 4, 8)]
    _load_into(tmp_path, saved, ROW_WISE, targets)
    assert [t.tolist() for t in thirds] == [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]
    assert left.tolist() == right.tolist() == saved.tolist()  # a split shard starts from its parent's value


def test_a_row_wise_shard_from_a_data_parallel_replica_reads_its_rows(tmp_path):
    bottom = torch.zeros(3)
    _load_into(tmp_path, torch.arange(6.0).reshape(6, 1) + 1, TableLayout("data_parallel", ()), [RowwiseTarget(bottom, 3, 0, 8)])
    assert bottom.tolist() == [4.0, 5.0, 6.0]


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_row_wise_and_stacked_accumulator_shards_name_their_rows_and_columns(one_rank_group):
    # Row-wise: two row ranges of one (6,) vector (here both on this one rank).
    halves = [torch.zeros(3), torch.zeros(3)]
    row_wise = init_from_local_shards([Shard.from_tensor_and_offsets(h, [3 * i], 0) for i, h in enumerate(halves)], 6)
    targets = rowwise_targets(row_wise, 6, ROW_WISE.column_ranges(8))
    assert [(t.row, t.col_start, t.col_stop) for t in targets] == [(0, 0, 8), (3, 0, 8)]
    assert [t.tensor.data_ptr() for t in targets] == [h.data_ptr() for h in halves]  # written in place
    # Column-wise: the two column shards' vectors stacked into (12,).
    stacked = init_from_local_shards([Shard.from_tensor_and_offsets(h, [6 * i], 0) for i, h in enumerate([torch.zeros(6)] * 2)], 12)
    targets = rowwise_targets(stacked, 6, COLUMN_WISE.column_ranges(8))
    assert [(t.row, t.col_start, t.col_stop) for t in targets] == [(0, 0, 4), (0, 4, 8)]


def test_adam_state_between_data_parallel_and_a_fused_sharding_is_refused_naming_the_table(tmp_path):
    data_parallel = {"t": TableLayout("data_parallel", ()), "u": TableLayout("table_wise", ((0, 0, 6, 8, 0),))}
    fused = {"t": TableLayout("table_wise", ((0, 0, 6, 8, 1),)), "u": TableLayout("column_wise", COLUMN_WISE.shards)}
    saved_adam = {f"optimizer_states.0.state.sparse.embedding_bags.t.weight.{name}": None for name in ("exp_avg", "exp_avg_sq", "step")}
    with pytest.raises(ValueError, match=r"table t was trained with model.sparse_optimizer adam under data_parallel and this run shards it table_wise"):
        refuse_adam_across_data_parallel(tmp_path, saved_adam, data_parallel, fused)
    saved_adagrad = {"optimizer_states.0.state.sparse.embedding_bags.t.weight.sum": None}
    refuse_adam_across_data_parallel(tmp_path, saved_adagrad, data_parallel, fused)  # Adagrad's state is mapped
    refuse_adam_across_data_parallel(tmp_path, saved_adam, data_parallel, data_parallel)  # same plan: loads as it is


def _shards_predictions_and_kernel_steps(cli) -> dict:
    """shards_and_predictions, plus the step count (``iter``) of every FBGEMM kernel on the rank."""
    return {**shards_and_predictions(cli), "kernel_steps": [int(k.iter) for k in training_kernels(cli.trainer.lightning_module)]}


def test_a_plan_saved_with_gpu_placements_resumes_on_cpu_and_the_kernels_continue_the_step_count(checkpoint_writer, sample, tmp_path):
    # The writer's step-8 checkpoint as a GPU run would have written it: every placement on cuda:<rank>.
    # Copied with `cp -rL` as docs/checkpoints.md says a checkpoint may be: the link becomes a plain folder.
    checkpoint = tmp_path / "gpu_written.ckpt"
    link = checkpoint_writer["root"] / "checkpoints" / "step=8.ckpt"
    assert link.is_symlink()
    subprocess.run(["cp", "-rL", str(link), str(checkpoint)], check=True, timeout=60)
    assert checkpoint.is_dir() and not checkpoint.is_symlink()
    meta = json.loads((checkpoint / "meta.json").read_text())
    for parameters in meta["sharding_plan"]["modules"].values():
        for parameter in parameters.values():
            for shard in parameter["shards"] or []:
                rank = shard["placement"].split("/")[0]
                shard["placement"] = f"{rank}/cuda:{rank.removeprefix('rank:')}"
    (checkpoint / "meta.json").write_text(json.dumps(meta))
    args = fit_with_checkpoints(sample, tmp_path, 2, plan_args("table_wise", WRITER_PLAN), ["--ckpt_path", str(checkpoint)])
    ranks = run_on_ranks(2, args, tmp_path, _shards_predictions_and_kernel_steps)
    # The saved plan was reused (on the CPU) and training continued exactly as the uninterrupted writer.
    assert [r["shards"] for r in ranks][0] == checkpoint_writer["result"]["shards"]
    np.testing.assert_allclose(ranks[0]["probabilities"], checkpoint_writer["result"]["probabilities"], rtol=0, atol=1e-6)
    # Every fused kernel's step count (FBGEMM's Adam corrects its bias by it) starts from the saved
    # global_step, 8, and FBGEMM adds one per forward: 8 training steps, then the inspection's
    # prediction; the validation batches between are put back (app/train/fused_step_count.py). Not
    # restored, it would read 9; with the validation batches counted, 21.
    assert ranks[0]["global_step"] == 16
    assert ranks[0]["kernel_steps"] and set(ranks[0]["kernel_steps"]) == {8 + 8 + 1}
    plan = json.loads((tmp_path / "sharding_plan.json").read_text())["plan"]
    placements = {s["placement"] for p in plan["modules"].values() for q in p.values() for s in q["shards"] or []}
    assert placements == {"rank:0/cpu", "rank:1/cpu"}  # the run's own devices in its plan report
