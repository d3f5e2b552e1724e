"""Vocabularies (``--frequency_threshold``, ``--vocabulary``): the counting pass that makes them
(per file's id counts, merged one feature at a time, the ids seen >= T times kept), choosing the one
a run maps with, and mapping raw ids to contiguous ids with it."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from app.data.preprocess.chunks import iter_chunks
from app.data.preprocess.config import Config, DayResult, DayTask
from app.data.preprocess.files import read_json, save_npy_atomically, save_npz_atomically, write_json_atomically
from app.data.preprocess.id_counts import IdCounter
from app.data.preprocess.resume import counted_already, input_info
from app.data.preprocess.workers import report_rows, run_tasks
from app.data.tsv import NUM_SPARSE

# Contiguous ids (TorchRec): 1 for rare or unseen ids, 2 for the first vocabulary entry.
RARE_ID = 1
FIRST_CONTIGUOUS_ID = 2


def vocabulary_path(folder: Path, feature: int) -> Path:
    return folder / f"vocab_feature_{feature}.npy"


def load_vocabularies(folder: Path) -> list[np.ndarray]:
    """The 26 sorted raw-id vocabularies saved in ``folder`` (memory-mapped)."""
    vocabularies = []
    for j in range(NUM_SPARSE):
        path = vocabulary_path(folder, j)
        if not path.is_file():
            raise FileNotFoundError(
                f"{path}: missing; a vocabulary folder holds vocab_feature_0.npy .. vocab_feature_25.npy"
            )
        vocabularies.append(np.load(path, mmap_mode="r"))
    return vocabularies


def map_to_contiguous(raw_ids: np.ndarray, vocabularies: Sequence[np.ndarray]) -> np.ndarray:
    """Raw ids (rows, 26) -> contiguous ids: vocabulary position + 2, or 1 when not in it."""
    out = np.empty(raw_ids.shape, dtype=np.int64)
    for j, vocabulary in enumerate(vocabularies):
        column = raw_ids[:, j]
        if vocabulary.size == 0:
            out[:, j] = RARE_ID
            continue
        position = np.minimum(np.searchsorted(vocabulary, column), vocabulary.size - 1)
        found = vocabulary[position] == column
        out[:, j] = np.where(found, position + FIRST_CONTIGUOUS_ID, RARE_ID)
    return out


def count_ids(task: DayTask) -> DayResult:
    """First pass of ``--frequency_threshold``: every id of one file with its count, saved as
    ``day_N_id_counts.npz`` (files, not pickles through a pipe: a Terabyte day has ~10**8 ids)."""
    started = time.perf_counter()
    counter, rows = IdCounter(), 0
    for arrays, _ in iter_chunks(task.input, task.dense_transform, task.on_bad_rows, task.block_bytes):
        counter.add_ids(arrays.sparse)
        rows += len(arrays)
        report_rows(len(arrays))
    members = {}
    for j, (ids, counts) in enumerate(counter.per_feature()):
        members[f"ids_{j}"], members[f"counts_{j}"] = ids.astype(np.uint32), counts
    save_npz_atomically(task.path("id_counts.npz"), info=np.array(json.dumps(input_info(task))), **members)
    return DayResult(task.day, rows, time.perf_counter() - started)


def _save_vocabularies(folder: Path, count_files: Sequence[Path], threshold: int, description: dict) -> list[int]:
    """Merge the files' id counts one feature at a time (memory: one feature's distinct ids), keep
    the ids seen >= threshold times; ``vocabulary.json`` is written last, marking them complete."""
    sizes = []
    for j in range(NUM_SPARSE):
        counter = IdCounter()
        for path in count_files:
            with np.load(path) as counts:
                counter.add_counts(counts[f"ids_{j}"].astype(np.int64), counts[f"counts_{j}"])
        counter.merge()
        kept = counter.keys[counter.counts >= threshold]
        save_npy_atomically(vocabulary_path(folder, j), kept)
        sizes.append(int(kept.size))
    write_json_atomically(folder / "vocabulary.json", dict(description, sizes=sizes))
    return sizes


def prepare_vocabulary(config: Config, inputs: Sequence[Path]) -> dict[str, Any] | None:
    """The vocabulary to map ids with: None (raw ids), a given one, or one counted now (or saved by
    an earlier run over the same inputs with the same threshold)."""
    if config.vocabulary is not None:
        description = read_json(config.vocabulary / "vocabulary.json")
        load_vocabularies(config.vocabulary)  # fail now, naming a missing file, not in every worker
        return dict(description, dir=config.vocabulary)
    if not config.frequency_threshold:
        return None
    # Inputs by name and size, not path: a re-run from another folder is the same run.
    described = [{"name": path.name, "bytes": path.stat().st_size} for path in inputs]
    description = {"threshold": config.frequency_threshold, "inputs": described}
    saved = config.output / "vocabulary.json"
    if saved.is_file():
        previous = read_json(saved)
        if {k: previous.get(k) for k in description} != description:
            # Never overwrite it: days already written there were mapped with it.
            raise ValueError(
                f"{saved}: made with threshold {previous.get('threshold')} from other inputs or with another "
                f"threshold than --frequency_threshold {config.frequency_threshold} now; use a new --output folder"
            )
        print(f"reusing the vocabularies in {config.output} (same inputs and threshold)", file=sys.stderr)
        return dict(previous, dir=config.output)
    tasks = [DayTask(i, p, config.output, config.dense_transform, config.on_bad_rows, config.block_mib << 20, None)
             for i, p in enumerate(inputs)]
    todo = [task for task in tasks if not counted_already(task)]
    run_tasks(count_ids, todo, config.workers, "counting ids", config.progress)
    count_files = [task.path("id_counts.npz") for task in tasks]
    sizes = _save_vocabularies(config.output, count_files, config.frequency_threshold, description)
    for path in count_files:  # the vocabulary replaces them
        path.unlink()
    return dict(description, sizes=sizes, dir=config.output)
