"""``metadata.json``: the whole set of days described from their stats sidecars (rows, positives,
skipped rows, distinct ids), with how the ids and dense features were made and from which inputs."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from app.criteo import NUM_SPARSE
from app.data.preprocess.config import FORMAT_VERSION, Config, DayTask
from app.data.preprocess.files import read_sidecar_info
from app.data.preprocess.vocabulary import FIRST_CONTIGUOUS_ID


def build_metadata(config: Config, tasks: Sequence[DayTask], vocabulary: dict[str, Any] | None) -> dict[str, Any]:
    """metadata.json: per day and overall row counts, positives, skipped rows and distinct raw ids,
    plus how the ids and dense features were made and from which inputs."""
    days = [_day_entry(task, read_sidecar_info(task.path("stats.npz"))) for task in tasks]
    labelled_rows = sum(d["rows"] for d in days if d["labelled"])
    positives = sum(d["positives"] for d in days if d["labelled"])
    return {
        "format": "torchrec_numpy_days",
        "format_version": FORMAT_VERSION,
        "dense_transform": config.dense_transform,
        "frequency_threshold": vocabulary["threshold"] if vocabulary else 0,
        "sparse_ids": "contiguous" if vocabulary else "raw",
        "vocabulary_dir": str(vocabulary["dir"]) if vocabulary else None,
        "vocabulary_sizes": vocabulary["sizes"] if vocabulary else None,
        "num_embeddings_per_feature": [s + FIRST_CONTIGUOUS_ID for s in vocabulary["sizes"]] if vocabulary else None,
        "on_bad_rows": config.on_bad_rows,
        "total_rows": sum(d["rows"] for d in days),
        "positives": positives,
        "positive_rate": positives / labelled_rows if labelled_rows else None,
        "skipped_rows": sum(d["skipped_rows"] for d in days),
        "distinct_ids_per_feature": _distinct_over_days([task.path("stats.npz") for task in tasks]),
        "inputs": _describe_inputs([task.input for task in tasks]),
        "days": days,
    }


def _distinct_over_days(stats_files: Sequence[Path]) -> list[int]:
    """Distinct raw ids per feature over all days: the union of the days' distinct ids, one
    feature at a time (memory: one feature's ids)."""
    distinct = []
    for j in range(NUM_SPARSE):
        seen = np.empty(0, dtype=np.uint32)
        for path in stats_files:
            with np.load(path) as stats:
                seen = np.union1d(seen, stats[f"unique_{j}"])
        distinct.append(int(seen.size))
    return distinct


def _day_entry(task: DayTask, info: dict[str, Any]) -> dict[str, Any]:
    rows, positives = info["rows"], info["positives"]
    return {
        "day": task.day,
        "files": [task.path(p).name for p in ("dense.npy", "sparse.npy", "labels.npy")],
        "input": task.input.name,
        "input_bytes": info["input_bytes"],
        "rows": rows,
        "labelled": info["labelled"],
        "positives": positives if info["labelled"] else 0,
        "positive_rate": positives / rows if rows and info["labelled"] else None,
        "skipped_rows": info["skipped_rows"],
        "first_skipped_row": info["first_bad_row"],  # an example of what was wrong, "file:line: ..."
        "distinct_ids_per_feature": info["distinct_ids_per_feature"],
    }


def _describe_inputs(inputs: Sequence[Path]) -> list[dict[str, Any]]:
    return [{"name": path.name, "path": str(path), "bytes": path.stat().st_size} for path in inputs]
