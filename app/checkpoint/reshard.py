"""Loading a sharded checkpoint under another world size or sharding plan than the one that wrote it.

A checkpoint holds every table's weights as ``torch.distributed.checkpoint`` (DCP) chunks tagged with
their global offsets, so the weights need no help: DCP reads, for each shard this rank holds now,
exactly the overlapping pieces of the saved chunks (table-wise <-> column-wise <-> data-parallel,
any world size), and no rank materialises a table it does not hold. (A data-parallel table is a full
replica on every rank by definition; that is the plan's choice, not the loader's.)

The embedding optimizer's state is where plans disagree (torchrec#2394). Its keys and shapes depend
on the sharding type that trained the table:

=====================  ============================================  ===========================
optimizer              fused (table-wise, column-wise, row-wise)     data-parallel (plain optim)
=====================  ============================================  ===========================
element-wise Adagrad   ``<param>.<table>.momentum1`` (rows, D),       ``<param>.sum`` (rows, D)
                       sharded like the weight
row-wise Adagrad       ``<param>.<table>.momentum1``: (rows,) per     ``<param>.sum`` (rows, 1)
                       column shard, the K column shards' vectors
                       stacked into (K * rows,)
=====================  ============================================  ===========================

Design: checkpoints are written unchanged (each plan's own keys, so resuming under the same plan
stays bit-exact and costs nothing extra); the mapping happens at load time, from the saved plan
(stored with every checkpoint) to the current one, table by table:

* element-wise state has the global shape (rows, D) under every plan: it is read under its saved key
  into the current tensor and DCP reshards it like a weight;
* row-wise state is one accumulator per row *and column shard*: FBGEMM adds the mean over the
  shard's columns of the squared gradient. A new shard covering columns [a, b) gets the
  column-weighted mean of the saved shards' accumulators over [a, b): exactly what a wider shard
  would have accumulated when shards merge (column-wise -> table-wise), the saved value itself when
  the columns are unchanged, and the best available estimate when a shard is split (a finer shard's
  accumulator was never recorded). Each rank reads only the rows of the saved vectors that its own
  shards need, through a DCP planner that loads slices (``SliceLoadPlanner``).

The dense optimizer's state has the same keys under every plan. Changing the optimizer itself
(e.g. element-wise to row-wise Adagrad) is refused with a message naming the table.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.storage import StorageReader
from torch import nn
from torchrec.distributed.types import ShardingPlan
from torchrec.optim.keyed import KeyedOptimizer

_TABLE_IN_KEY = re.compile(r"embedding_bags\.([^.]+)\.weight(?:\.|$)")
_ACCUMULATOR_NAMES = ("momentum1", "sum")


@dataclass(frozen=True)
class TableLayout:
    """Where a table's pieces live under a plan: its sharding type and (row, col, rows, cols, rank) shards."""

    sharding_type: str
    shards: tuple[tuple[int, int, int, int, int], ...]  # empty for a data-parallel replica

    def column_ranges(self, embedding_dim: int) -> list[tuple[int, int]]:
        """The distinct column ranges of the shards, left to right (one range: the whole width)."""
        ranges = sorted({(col, col + cols) for _, col, _, cols, _ in self.shards})
        return ranges or [(0, embedding_dim)]


def table_layouts(plan: ShardingPlan) -> dict[str, TableLayout]:
    """Every table's layout under ``plan``, keyed by table name."""
    layouts = {}
    for module_plan in plan.plan.values():
        for table, sharding in module_plan.items():  # type: ignore[union-attr]
            spec = sharding.sharding_spec
            shards = tuple(
                sorted(
                    (*shard.shard_offsets, *shard.shard_sizes, shard.placement.rank())  # type: ignore[union-attr]
                    for shard in (spec.shards if spec is not None else [])
                )
            )
            layouts[table] = TableLayout(sharding.sharding_type, shards)
    return layouts


def same_layout(saved: ShardingPlan, current: ShardingPlan) -> bool:
    """True when every table sits in the same shards on the same ranks: the checkpoint loads as it is."""
    return table_layouts(saved) == table_layouts(current)


def plan_allows(plan: ShardingPlan, allowed_types: Mapping[str, Sequence[str] | None], world_size: int) -> bool:
    """Whether ``plan`` fits this run: written for ``world_size`` ranks and within each table's allowed types.

    ``allowed_types`` maps a table to its allowed sharding types (None or absent: any).
    """
    for table, layout in table_layouts(plan).items():
        if any(rank >= world_size for *_, rank in layout.shards):
            return False
        allowed = allowed_types.get(table)
        if allowed and layout.sharding_type not in allowed:
            return False
    return True


class SliceLoadPlanner(DefaultLoadPlanner):
    """Reads given slices of saved tensors into plain tensors.

    DCP reads into whole tensors or into the shards of a ShardedTensor/DTensor whose shards cover the
    global shape; a row range of another plan's stacked accumulator is neither, hence this planner.

    Args:
        slices: target name -> (saved key, offsets of the slice in the saved tensor); the slice's
            size is the target tensor's.
    """

    def __init__(self, slices: Mapping[str, tuple[str, Sequence[int]]]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.slices = dict(slices)

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        items = []
        for name, (saved_key, offsets) in self.slices.items():
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=self.state_dict[name].size())
            saved = self.metadata.state_dict_metadata[saved_key]
            assert isinstance(saved, TensorStorageMetadata)
            for item in create_read_items_for_chunk_list(saved_key, saved, [chunk]):
                items.append(dataclasses.replace(item, dest_index=MetadataIndex(name)))
        return LoadPlan(items)


@dataclass
class RowwiseTarget:
    """One piece of a current row-wise accumulator: rows [row, row + n) of the columns [col_start, col_stop)."""

    tensor: torch.Tensor  # (n,) view to write into
    row: int
    col_start: int
    col_stop: int


def load_resharded(
    checkpoint_dir: str | Path,
    module: nn.Module,
    optimizers: Sequence[KeyedOptimizer],
    saved_plan: ShardingPlan,
    current_plan: ShardingPlan,
    storage_reader: Callable[[], StorageReader] | None = None,
    process_group: Any = None,
) -> None:
    """Loads weights and optimizer state written under ``saved_plan`` into a module sharded by ``current_plan``.

    Collective: every rank calls it. ``storage_reader`` makes a fresh reader of the checkpoint for
    each DCP load (default: DCP's FileSystemReader); ``process_group`` carries DCP's collectives
    (None: the default group). Raises a ValueError naming the table when the
    optimizer state cannot be carried over.
    """
    path = Path(checkpoint_dir)
    reader = storage_reader or (lambda: dcp.FileSystemReader(path))
    saved_metadata = reader().read_metadata().state_dict_metadata
    saved_layouts, current_layouts = table_layouts(saved_plan), table_layouts(current_plan)
    for table, layout in (*saved_layouts.items(), *current_layouts.items()):
        if layout.sharding_type == "grid_shard":  # its row-wise state is stacked per node as well: not mapped here
            raise ValueError(f"{path}: table {table} is grid_shard; resharding supports the other sharding types")
    refuse_adam_across_data_parallel(path, saved_metadata, saved_layouts, current_layouts)
    model_state = module.state_dict()
    direct: dict[str, Any] = {f"state_dict.{key}": value for key, value in model_state.items()}
    rowwise: list[tuple[str, RowwiseTarget, TensorStorageMetadata]] = []
    optimizer_states = []
    for index, optimizer in enumerate(optimizers):
        optimizer.init_state()  # fused optimizer state is lazy: give DCP tensors to load into
        optimizer_states.append(optimizer.state_dict())
        for key, tensor in _flat_state(optimizer_states[-1], f"optimizer_states.{index}.state."):
            match = _TABLE_IN_KEY.search(key)
            if match is None:
                direct[key] = tensor  # dense parameters: the same keys under every plan
            elif not key.endswith(_ACCUMULATOR_NAMES):
                if key in saved_metadata:
                    direct[key] = tensor  # e.g. the step count of a replicated table's optimizer
            else:
                table = match.group(1)
                saved_key = _saved_accumulator_key(saved_metadata, index, table, path)
                saved_md = saved_metadata[saved_key]
                assert isinstance(saved_md, TensorStorageMetadata)
                rows, dim = model_state_shape(model_state, table)
                if not _rowwise_alike(tensor.size(), saved_md.size, dim, table, path):
                    direct[saved_key] = tensor  # the same global (rows, D) under every plan: DCP reshards it
                    continue
                for target in rowwise_targets(tensor, rows, current_layouts[table].column_ranges(dim)):
                    rowwise.append((saved_key, target, saved_md))
    dcp.load(direct, storage_reader=reader(), process_group=process_group)
    load_rowwise(path, reader, rowwise, saved_layouts, model_state, process_group=process_group)
    module.load_state_dict(model_state)
    for optimizer, state in zip(optimizers, optimizer_states):
        optimizer.load_state_dict(state)


def refuse_adam_across_data_parallel(
    path: Path, saved_metadata: Mapping[str, Any], saved: Mapping[str, TableLayout], current: Mapping[str, TableLayout]
) -> None:
    """Raises a ValueError naming the table when Adam state would move between data_parallel and a fused sharding.

    A data-parallel table is updated by torch's Adam (state ``exp_avg``, ``exp_avg_sq``, ``step`` per
    parameter), every other sharding type by FBGEMM's fused Adam (``<table>.momentum1``,
    ``<table>.exp_avg_sq``, and a step count inside the kernel). Mapping one onto the other is not
    done here: fused Adam runs on GPUs only, so such a mapping could not be tested on this project's
    CPUs. Refused before anything is read, instead of failing on a missing key (or, the other way
    round, silently starting the moments from zero).
    """
    for table, layout in current.items():
        was = saved.get(table)
        if was is None or (was.sharding_type == "data_parallel") == (layout.sharding_type == "data_parallel"):
            continue
        if any(f"embedding_bags.{table}.weight." in key and key.endswith(".exp_avg_sq") for key in saved_metadata):
            raise ValueError(
                f"{path}: table {table} was trained with model.sparse_optimizer adam under {was.sharding_type} and this "
                f"run shards it {layout.sharding_type}: torch's Adam (data_parallel) and FBGEMM's fused Adam (the other "
                "sharding types) keep different state, which is not carried from one to the other; keep the table "
                f"{'in' if was.sharding_type == 'data_parallel' else 'out of'} data_parallel with "
                "trainer.strategy.sharding_types or trainer.strategy.table_constraints"
            )


def _flat_state(optimizer_state: Mapping[str, Any], prefix: str) -> list[tuple[str, torch.Tensor]]:
    """(DCP key, tensor) of every state tensor: ``<prefix><param key>.<state name>``."""
    return [
        (f"{prefix}{param_key}.{name}", tensor)
        for param_key, param_state in optimizer_state["state"].items()
        for name, tensor in param_state.items()
    ]


def _rowwise_alike(size: Sequence[int], saved_size: Sequence[int], dim: int, table: str, path: Path) -> bool:
    """Whether a table's current and saved accumulators are row-wise (True) or element-wise (False) alike."""
    if _is_rowwise(size, dim) != _is_rowwise(saved_size, dim):
        saved = "row-wise" if _is_rowwise(saved_size, dim) else "element-wise"
        raise ValueError(
            f"{path}: table {table} was trained with another model.sparse_optimizer (its saved optimizer "
            f"state is {saved}); resume with the same one"
        )
    return _is_rowwise(size, dim)


def model_state_shape(model_state: Mapping[str, Any], table: str) -> tuple[int, int]:
    """(rows, D) of ``table`` from the module's state dict."""
    for key, value in model_state.items():
        if key.endswith(f"embedding_bags.{table}.weight"):
            rows, dim = value.size()
            return int(rows), int(dim)
    raise KeyError(table)


def _is_rowwise(size: Sequence[int], dim: int) -> bool:
    # Fused row-wise state is 1-D; a replicated table's row-wise Adagrad keeps (rows, 1).
    return len(size) == 1 or (len(size) == 2 and size[1] == 1 and dim != 1)


def _saved_accumulator_key(saved_metadata: Mapping[str, Any], index: int, table: str, path: Path) -> str:
    prefix = f"optimizer_states.{index}.state."
    for key in saved_metadata:
        if key.startswith(prefix) and f"embedding_bags.{table}.weight." in key and key.endswith(_ACCUMULATOR_NAMES):
            return key
    raise ValueError(
        f"{path}: no optimizer state for table {table}: the checkpoint was trained with a different "
        "model.sparse_optimizer (or without an optimizer); resume with the same one"
    )


def rowwise_targets(tensor: torch.Tensor, rows: int, column_ranges: list[tuple[int, int]]) -> list[RowwiseTarget]:
    """The pieces of the current row-wise accumulator this rank holds, with the rows and columns they serve."""
    if not isinstance(tensor, ShardedTensor):  # a replicated table: (rows, 1), all columns
        return [RowwiseTarget(tensor.view(-1), 0, column_ranges[0][0], column_ranges[-1][1])]
    stacked = tensor.size(0) // rows > 1  # column shards' vectors stacked, left to right
    targets = []
    for shard in tensor.local_shards():
        offset = shard.metadata.shard_offsets[0]
        if stacked:
            col_start, col_stop = column_ranges[offset // rows]
            targets.append(RowwiseTarget(shard.tensor, offset % rows, col_start, col_stop))
        else:
            targets.append(RowwiseTarget(shard.tensor, offset, column_ranges[0][0], column_ranges[-1][1]))
    return targets


def load_rowwise(
    path: Path,
    reader: Callable[[], StorageReader],
    rowwise: list[tuple[str, RowwiseTarget, TensorStorageMetadata]],
    saved_layouts: Mapping[str, TableLayout],
    model_state: Mapping[str, Any],
    process_group: Any = None,
) -> None:
    """Fills each row-wise target with the column-weighted mean of the saved shards' accumulators
    (``process_group`` carries DCP's collectives; None: the default group)."""
    slices: dict[str, tuple[str, list[int]]] = {}
    buffers: dict[str, torch.Tensor] = {}
    plans: list[tuple[RowwiseTarget, list[tuple[str, int]]]] = []
    for position, (saved_key, target, saved_md) in enumerate(rowwise):
        table = _TABLE_IN_KEY.search(saved_key).group(1)  # type: ignore[union-attr]
        rows, dim = model_state_shape(model_state, table)
        saved_ranges = saved_layouts[table].column_ranges(dim)
        if len(saved_md.size) == 1 and saved_md.size[0] != rows * len(saved_ranges) and saved_md.size[0] != rows:
            raise ValueError(f"{path}: the saved optimizer state of {table} does not match the saved sharding plan")
        if len(saved_md.size) == 1 and saved_md.size[0] == rows:
            saved_ranges = [(0, dim)]
        parts = []
        n = target.tensor.numel()
        for k, (start, stop) in enumerate(saved_ranges):
            overlap = min(stop, target.col_stop) - max(start, target.col_start)
            if overlap <= 0:
                continue
            name = f"{position}/{k}"
            if len(saved_md.size) == 1:
                slices[name] = (saved_key, [k * rows + target.row])
                buffers[name] = torch.empty(n, dtype=saved_md.properties.dtype)
            else:
                slices[name] = (saved_key, [target.row, 0])
                buffers[name] = torch.empty(n, 1, dtype=saved_md.properties.dtype)
            parts.append((name, overlap))
        plans.append((target, parts))
    # Every rank takes part in the collective load, also one with nothing to read.
    dcp.load(buffers, storage_reader=reader(), planner=SliceLoadPlanner(slices), process_group=process_group)
    with torch.no_grad():
        for target, parts in plans:
            width = target.col_stop - target.col_start
            target.tensor.copy_(column_weighted_mean([(buffers[name], overlap) for name, overlap in parts], width))


def column_weighted_mean(parts: Sequence[tuple[torch.Tensor, int]], width: int) -> torch.Tensor:
    """One row-wise accumulator for a shard of ``width`` columns from the saved shards' accumulators.

    Each part is (the saved accumulator's rows, how many of the new shard's columns it covered). FBGEMM
    adds the mean over a shard's columns of the squared gradient, so the width-weighted mean of the
    parts is what one shard over all those columns would have accumulated.
    """
    if len(parts) == 1 and parts[0][1] == width:
        return parts[0][0].reshape(-1)  # the same columns (or a split shard's parent): the saved value, exactly
    total = sum(part.reshape(-1).double() * overlap for part, overlap in parts)
    return (total / width).to(parts[0][0].dtype)
