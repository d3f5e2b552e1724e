"""Command lines of the checkpoint tests (test_reshard.py, test_export.py) and their shared writer run.

The writer trains on 2 processes under a mixed plan (t_cat_0 data-parallel, SPLIT_TABLE split into
two column shards, the rest table-wise) and saves at step 8 (mid-epoch) and step 16 (the end).
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.multiprocess import run_on_ranks
from tests.distributed.test_sharding import fit_args, shards_and_predictions

GLOBAL_BATCH = 96  # divisible by 1, 2 and 3 processes; 1,536 rows = 16 steps per epoch
SPLIT_TABLE = "t_cat_1"  # min_partition 4 of 8 columns: two column shards on any world size
WRITER_PLAN = {"t_cat_0": {"sharding_types": ["data_parallel"]},
               SPLIT_TABLE: {"sharding_types": ["column_wise"], "min_partition": 4}}  # fmt: skip


def plan_args(sharding_type: str, constraints: dict) -> list[str]:
    return ["--trainer.strategy.sharding_types", f"[{sharding_type}]",
            "--trainer.strategy.table_constraints", json.dumps(constraints)]  # fmt: skip


def fit_with_checkpoints(sample, root: Path, world_size: int, plan: list[str], extra: list[str] = ()) -> list[str]:
    """One epoch of 16 steps, a checkpoint every 8 steps into ``root/checkpoints/step=N.ckpt`` (the run folder's)."""
    args = fit_args(sample, root, "table_wise", GLOBAL_BATCH // world_size)
    args[args.index("--trainer.enable_checkpointing") + 1] = "true"
    args[args.index("--trainer.max_epochs") + 1] = "1"
    checkpoints = [
        "--checkpoint.filename", "{step}",
        "--checkpoint.every_n_train_steps", "8",
        "--checkpoint.save_top_k", "-1",
        "--checkpoint.monitor", "null",
        "--checkpoint.save_last", "false",
    ]  # fmt: skip
    return args + checkpoints + plan + list(extra)


def eval_args(sample, root: Path, subcommand: str, world_size: int, checkpoint, plan: list[str]) -> list[str]:
    """``validate``/``test``/``predict`` from ``checkpoint``; predict scores the validation rows."""
    args = fit_args(sample, root, "table_wise", GLOBAL_BATCH // world_size)
    args[0] = subcommand
    args.remove("--trainer.callbacks+=tests.embedding_init.ReferenceEmbeddings")
    args[args.index("--data.predict") + 1] = str(sample["val"])
    return args + plan + ["--ckpt_path", str(checkpoint)]


def table_key(table: str) -> str:
    return f"model.sparse_arch.embedding_bag_collection.embedding_bags.{table}.weight"


def run_writer(sample, root: Path) -> dict:
    """The 2-process writer run; returns its folder and rank 0's shards and final predictions."""
    (rank0, _) = run_on_ranks(2, fit_with_checkpoints(sample, root, 2, plan_args("table_wise", WRITER_PLAN)), root, shards_and_predictions)
    assert rank0["shards"][table_key(SPLIT_TABLE)] in ([((0, 0), (500, 4))], [((0, 4), (500, 4))])  # really split
    return {"root": root, "result": rank0}
