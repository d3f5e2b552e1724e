"""The whole run: check the options, expand the inputs, settle the vocabulary, convert the days not
already complete on worker processes, write ``metadata.json`` and print a summary."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from app.data.preprocess.config import Config, DayResult, DayTask, check_config
from app.data.preprocess.day import convert_day
from app.data.preprocess.files import write_json_atomically
from app.data.preprocess.metadata import build_metadata
from app.data.preprocess.resume import already_done, day_signature, warn_about_other_days
from app.data.preprocess.vocabulary import prepare_vocabulary
from app.data.preprocess.workers import run_tasks
from app.data.tsv import MAX_DEFAULT_THREADS, expand_paths


def run(config: Config) -> dict[str, Any]:
    """Preprocess ``config.inputs`` into ``config.output``; returns the metadata written."""
    started = time.perf_counter()
    check_config(config)
    inputs = expand_paths(config.inputs)
    config.output.mkdir(parents=True, exist_ok=True)
    vocabulary = prepare_vocabulary(config, inputs)
    signature = day_signature(config, vocabulary)
    tasks = [
        DayTask(day, path, config.output, config.dense_transform, config.on_bad_rows,
                config.block_mib << 20, vocabulary["dir"] if vocabulary else None, signature,
                parquet_schema=config.parquet_schema)
        for day, path in enumerate(inputs)
    ]
    warn_about_other_days(config.output, len(tasks))
    todo = [task for task in tasks if not already_done(task)]
    # Fewer files than cores (Kaggle's one train.txt): each worker parses on several threads.
    processes = max(1, min(config.workers, len(todo)))
    threads = max(1, min(MAX_DEFAULT_THREADS, config.workers // processes))
    todo = [dataclasses.replace(task, num_threads=threads) for task in todo]
    results = run_tasks(convert_day, todo, config.workers, "converting", config.progress)
    metadata = build_metadata(config, tasks, vocabulary)
    write_json_atomically(config.output / "metadata.json", metadata)
    _print_summary(results, len(tasks), config.workers, time.perf_counter() - started, config.output)
    return metadata


def _print_summary(
    results: Sequence[DayResult], num_days: int, workers: int, wall_seconds: float, output: Path
) -> None:
    rows = sum(r.rows for r in results)
    busy = sum(r.busy_seconds for r in results)
    used = max(1, min(workers, len(results)))
    rate = rows / wall_seconds if wall_seconds > 0 else 0.0
    per_worker = rows / busy if busy > 0 else 0.0
    skipped = num_days - len(results)
    already = f"; {skipped} already complete" if skipped else ""
    print(
        f"preprocessed {rows:,} rows ({len(results)} of {num_days} days{already}) into {output} in "
        f"{wall_seconds:.1f} s: {rate:,.0f} rows/s, {per_worker:,.0f} rows/s per worker "
        f"({used} worker{'s' if used > 1 else ''}; per worker = rows / seconds the workers spent converting)"
    )
