"""``python -m app.bench.serve``: scoring latency and throughput of a pt2 package (float32 and INT8) against the
app's own predict path, on the same raw rows, in one process (docs/serving.md).

The app's path is what ``python -m app predict`` runs per batch, without the Trainer's loop around it: the data
road's id mapping and dense transform in NumPy (``id mod table size``, or the vocabulary's binary search;
``log1p``), ``make_batch``'s KeyedJaggedTensor, and the model under TorchRec's ``DistributedModelParallel`` on
one process (its default plan; FBGEMM's CPU embedding kernels), then the sigmoid. The package's path is
``ServingPackage.score``: its input checks, then the compiled graph (mapping and transform included).

Each path scores batches of 1, 64 and 512 rows cut from the rows given (repeated if too few): ``calls`` timed
calls per size after ``warmup`` untimed ones. Printed per size and path: p50 and p99 latency (ms) and rows/s
(rows over the mean latency); then the app's time per row over each package's at every size, and the packages'
bytes (with INT8, its file's and its tables' bytes over float32's).

Example::

    python -m app.bench.serve --ckpt_path runs/demo/model.pt --rows data/sample/val.tsv
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.datasets.criteo import DEFAULT_CAT_NAMES

from app.checkpoint.export_pt2 import SavedWeights, export_pt2, read_saved_weights
from app.checkpoint.serving_runtime import ServingPackage, read_tsv_rows
from app.command import run_command
from app.data.batches import make_batch
from app.data.preprocess import map_to_contiguous
from app.data.source import RowBlock
from app.model.dlrm import build_dlrm, build_dlrm_arguments, table_name

BATCH_ROWS = (1, 64, 512)


def sharded_model(saved: SavedWeights) -> nn.Module:
    """The trained DLRM under DistributedModelParallel on one gloo process, as predict holds it."""
    from torchrec.distributed.model_parallel import DistributedModelParallel

    if not dist.is_initialized():  # one process: an in-memory store, no port to find
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(minutes=5))
    model = build_dlrm(**{**build_dlrm_arguments(saved.hyper_parameters), "num_embeddings_per_feature": _table_sizes(saved)})
    sharded = DistributedModelParallel(model, device=torch.device("cpu"))
    target = sharded.state_dict()  # the tables as ShardedTensors: one process holds every shard
    with torch.no_grad():
        for key, value in target.items():
            full = saved.state_dict[f"model.{key}"]
            if isinstance(value, ShardedTensor):
                for shard in value.local_shards():
                    index = tuple(slice(o, o + n) for o, n in zip(shard.metadata.shard_offsets, shard.metadata.shard_sizes))
                    shard.tensor.copy_(full[index])
            else:
                value.copy_(full)
    sharded.load_state_dict(target)
    return sharded.eval()


def app_scorer(saved: SavedWeights) -> Callable[[np.ndarray, np.ndarray], torch.Tensor]:
    """The app's predict path per batch: NumPy mapping and transform, make_batch, the sharded model, sigmoid."""
    model = sharded_model(saved)
    sizes = np.asarray(_table_sizes(saved))
    vocabularies = None if saved.vocabulary_ids is None else [v.numpy() for v in saved.vocabulary_ids]

    def score(dense_counts: np.ndarray, raw_ids: np.ndarray) -> torch.Tensor:
        ids = raw_ids if vocabularies is None else map_to_contiguous(raw_ids, vocabularies)
        ids = np.remainder(ids, sizes)
        dense = np.log1p(np.maximum(dense_counts, 0).astype(np.float64)).astype(np.float32)
        batch = make_batch(RowBlock(dense, ids, np.full(len(dense), -1, np.float32)), np.arange(len(dense)))
        with torch.no_grad():
            return torch.sigmoid(model(batch.dense_features, batch.sparse_features).squeeze(-1).float())

    return score


def _table_sizes(saved: SavedWeights) -> list[int]:
    """Rows of each table, in feature order (a checkpoint lists its keys sorted as text: t_cat_10 before t_cat_2)."""
    prefix = "model.sparse_arch.embedding_bag_collection.embedding_bags."
    keys = [f"{prefix}{table_name(feature)}.weight" for feature in DEFAULT_CAT_NAMES]
    return [int(saved.state_dict[key].shape[0]) for key in keys if key in saved.state_dict]


def latencies_ms(score: Callable[[Any, Any], Any], dense: Any, ids: Any, calls: int, warmup: int) -> np.ndarray:
    """``calls`` timed calls of ``score`` on the same batch, after ``warmup`` untimed ones (milliseconds)."""
    for _ in range(warmup):
        score(dense, ids)
    times = np.empty(calls)
    for i in range(calls):
        started = time.perf_counter()
        score(dense, ids)
        times[i] = time.perf_counter() - started
    return times * 1e3


def measure(scorers: dict[str, Callable], dense: torch.Tensor, ids: torch.Tensor, calls: int, warmup: int) -> list[dict]:
    """One record per batch size and path: p50/p99 latency (ms) and rows/s."""
    records = []
    for rows in BATCH_ROWS:
        repeats = -(-rows // dense.shape[0])
        batch_dense, batch_ids = dense.repeat(repeats, 1)[:rows], ids.repeat(repeats, 1)[:rows]
        for name, score in scorers.items():
            inputs = (batch_dense, batch_ids) if name.startswith("pt2") else (batch_dense.numpy(), batch_ids.numpy())
            times = latencies_ms(score, *inputs, calls, warmup)
            records.append({"rows": rows, "path": name, "p50_ms": float(np.percentile(times, 50)),
                            "p99_ms": float(np.percentile(times, 99)), "rows_per_s": rows / float(times.mean()) * 1e3})  # fmt: skip
    return records


def agreement(scorers: dict[str, Callable], dense: torch.Tensor, ids: torch.Tensor) -> dict[str, float]:
    """Per package: the largest difference of its probabilities from the app's on the rows given."""
    expected = scorers["app-predict"](dense.numpy(), ids.numpy())
    return {name: float((score(dense, ids) - expected).abs().max()) for name, score in scorers.items() if name != "app-predict"}


def ratios(records: list[dict]) -> list[dict]:
    """Per batch size: the app's mean time per row over each package's (above 1: the package is faster)."""
    by = {(r["rows"], r["path"]): r["rows_per_s"] for r in records}
    return [{"rows": rows, "path": path, "app_time_over_package_time": by[(rows, path)] / by[(rows, "app-predict")]}
            for rows in BATCH_ROWS for path in ("pt2-fp32", "pt2-int8") if (rows, path) in by]  # fmt: skip


def bench_serve(
    ckpt_path: str,
    rows: str,
    package: str | None = None,
    int8_package: str | None = None,
    int8: bool = True,
    calls: int = 200,
    warmup: int = 20,
    threads: int = 0,
    output_json: str | None = None,
) -> list[dict]:
    """Latency p50/p99 at 1, 64 and 512 rows and throughput: pt2 packages (float32, INT8) against the app's predict path.

    Args:
        ckpt_path: a checkpoint folder or a model file from ``python -m app export``: the model all paths score with.
        rows: a labelled Criteo TSV file whose rows are scored (repeated up to 512 rows if fewer).
        package: the float32 pt2 package of ``ckpt_path``; exported into a temporary folder when not given.
        int8_package: the INT8 package; exported when not given (and ``int8``).
        int8: whether to measure an INT8 package too.
        calls: timed calls per batch size and path.
        warmup: untimed calls before them.
        threads: torch's intra-op threads for every path (0: torch's default).
        output_json: also write the records and ratios to this file.
    """
    if threads:
        torch.set_num_threads(threads)
    source = Path(ckpt_path).expanduser()
    dense, ids, _ = read_tsv_rows(rows)
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as work:  # packages exported for this run only
        packages = {"pt2-fp32": Path(package) if package else export_pt2(source, Path(work) / "model.pt2")}
        if int8:
            packages["pt2-int8"] = Path(int8_package) if int8_package else export_pt2(source, Path(work) / "model-int8.pt2", "int8")
        loaded = {name: ServingPackage(path) for name, path in packages.items()}
        scorers: dict[str, Callable] = {name: package.score for name, package in loaded.items()}
        sizes = {name: path.stat().st_size for name, path in packages.items()}
        table_bytes = {name: package.contract.get("constant_bytes", {}).get("tables") for name, package in loaded.items()}
        scorers["app-predict"] = app_scorer(read_saved_weights(source))
        try:
            differences = agreement(scorers, dense, ids)
            records = measure(scorers, dense, ids, calls, warmup)
        finally:
            dist.destroy_process_group()  # the one-process group of the app's path
    summary = {"records": records, "ratios": ratios(records), "package_bytes": sizes, "table_bytes": table_bytes,
               "max_abs_difference": differences, "torch": torch.__version__, "threads": torch.get_num_threads()}  # fmt: skip
    print_summary(summary)
    if output_json:
        Path(output_json).write_text(json.dumps(summary, indent=1))
    return records


def print_summary(summary: dict[str, Any]) -> None:
    """The records as a table, then the ratios, the largest differences and the package sizes."""
    print(f"{'rows':>5} {'path':<12} {'p50 ms':>9} {'p99 ms':>9} {'rows/s':>11}")
    for r in summary["records"]:
        print(f"{r['rows']:>5} {r['path']:<12} {r['p50_ms']:>9.3f} {r['p99_ms']:>9.3f} {r['rows_per_s']:>11.0f}")
    for r in summary["ratios"]:
        print(f"{r['rows']:>5} rows: app predict time per row / {r['path']} = {r['app_time_over_package_time']:.2f}")
    differences = summary["max_abs_difference"]
    print("max |probability - app predict's| over the rows: " + ", ".join(f"{k} {v:.2e}" for k, v in differences.items()))
    print("package bytes: " + ", ".join(f"{k} {v}" for k, v in summary["package_bytes"].items()))
    sizes, tables = summary["package_bytes"], summary["table_bytes"]
    if "pt2-int8" in sizes:  # the whole file, and the tables alone (the rest is the same in both)
        table_ratio = f", tables {tables['pt2-int8'] / tables['pt2-fp32']:.4f}" if tables["pt2-int8"] and tables["pt2-fp32"] else ""
        print(f"int8 / float32 bytes: file {sizes['pt2-int8'] / sizes['pt2-fp32']:.4f}{table_ratio}")


def main(argv: list[str] | None = None) -> None:
    """``python -m app.bench.serve --ckpt_path MODEL --rows ROWS.tsv`` (``--help``)."""
    status = run_command(bench_serve, "python -m app.bench.serve", argv)
    if status:
        raise SystemExit(status)


if __name__ == "__main__":
    main()
