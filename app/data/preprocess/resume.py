"""Resuming: what identifies a day (its input file by name and size, and the options that shape
it), and which days and first-pass id counts an earlier run into the same folder already finished.
A day with the same input but other options is an error, never silently mixed in."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

from app.data.preprocess.config import FORMAT_VERSION, Config, DayTask
from app.data.preprocess.files import read_sidecar_info


def input_info(task: DayTask) -> dict[str, Any]:
    """What identifies a day's input file (and the reading options) in its sidecar files."""
    return {"input": str(task.input), "input_bytes": task.input.stat().st_size, "on_bad_rows": task.on_bad_rows}


def day_signature(config: Config, vocabulary: dict[str, Any] | None) -> dict[str, Any]:
    """What a day's content depends on besides its input file: equal signatures, equal days."""
    return {
        "format_version": FORMAT_VERSION,
        "dense_transform": config.dense_transform,
        "frequency_threshold": vocabulary["threshold"] if vocabulary else 0,
        "vocabulary_sizes": vocabulary["sizes"] if vocabulary else None,
    } | ({"parquet_schema": config.parquet_schema} if config.parquet_schema else {})


def counted_already(task: DayTask) -> bool:
    """Whether an interrupted earlier run left this input's id counts (first pass) complete."""
    path = task.path("id_counts.npz")
    identity = ("input_bytes", "on_bad_rows")
    if not path.is_file():
        return False
    info, current = read_sidecar_info(path), input_info(task)
    if Path(info["input"]).name == task.input.name and all(info[k] == current[k] for k in identity):
        print(f"day {task.day}: ids already counted ({task.input.name})", file=sys.stderr)
        return True
    return False


def already_done(task: DayTask) -> bool:
    """Whether the day's files are complete and made from this input with these options."""
    parts = ("dense.npy", "sparse.npy", "labels.npy", "stats.npz")
    if not all(task.path(part).is_file() for part in parts):
        return False
    info = read_sidecar_info(task.path("stats.npz"))
    source = f"{info['input']} ({info['input_bytes']} bytes)"
    current = f"{task.input} ({task.input.stat().st_size} bytes)"
    if Path(info["input"]).name != task.input.name or info["input_bytes"] != task.input.stat().st_size:
        raise ValueError(
            f"{task.path('dense.npy')}: day {task.day} was made from {source}, but input {task.day} is now "
            f"{current}; use a new --output folder, or delete that day's files"
        )
    if info["signature"] != task.signature:
        raise ValueError(
            f"{task.path('dense.npy')}: day {task.day} was made with other options ({info['signature']}, now "
            f"{task.signature}); use a new --output folder, or delete the day files there"
        )
    print(f"day {task.day}: complete in {task.output}, skipped ({task.input.name})", file=sys.stderr)
    return True


def warn_about_other_days(output: Path, num_days: int) -> None:
    """Day files beyond this run's inputs (from an earlier run) would be read as part of the set."""
    extra = sorted(
        int(m.group(1)) for p in output.glob("day_*_dense.npy")
        if (m := re.fullmatch(r"day_(\d+)_dense\.npy", p.name)) and int(m.group(1)) >= num_days
    )
    if extra:
        print(
            f"warning: {output} also holds days {extra}, not made from these {num_days} inputs; "
            "they are not in metadata.json but a reader of all days in the folder would include them",
            file=sys.stderr,
        )
