"""Raw Criteo TSV -> TorchRec's NumPy day files, streamed, in parallel, resumable.

Usage::

    python -m app.preprocess --input day_0.gz day_1.gz ... --output DIR [--workers N]
    python -m app.preprocess --input 'raw/day_*' --output DIR --frequency-threshold 3
    python -m app.preprocess --input test.txt --output DIR_TEST --vocabulary DIR   # map like DIR

Input file ``i`` (in the order given, after glob/directory expansion) becomes day ``i``:

* ``day_i_dense.npy``   float32 (rows, 13): the transformed integer features (``--dense-transform``)
* ``day_i_sparse.npy``  int64 (rows, 26): the raw 32-bit hashed ids, or contiguous ids with
  ``--frequency-threshold``/``--vocabulary`` (ids seen >= T times -> 2, 3, ...; the others -> 1,
  TorchRec's contiguous_preproc_criteo convention)
* ``day_i_labels.npy``  int32 (rows, 1): 0/1, or -1 for an unlabelled (39-field) file
* ``day_i_stats.npz``   this day's counts and distinct raw ids (for metadata.json and resuming)

and ``metadata.json`` describes the whole set (see ``build_metadata``). Read the result with
``app.data.numpy_days.NumpyDaysSource``.

``--frequency-threshold T`` makes two passes: the first counts every id per feature in each file
(``day_i_id_counts.npz``, in parallel), merges the counts one feature at a time and saves the ids
seen >= T times as ``vocab_feature_j.npy`` (sorted raw ids, int64) with ``vocabulary.json``; the
second writes the days with contiguous ids. ``--vocabulary DIR`` maps with the vocabularies of an
earlier run instead (e.g. test data like the training data).

Streaming: every chunk of parsed rows is appended to the three output files at once, so memory is
bounded by the chunk size, not the input size. Each .npy file starts with the header for zero rows,
which NumPy pads so that the row count can grow to 21 digits without changing the header's length
(``numpy.lib.format.GROWTH_AXIS_MAX_DIGITS``); when the day is done the header is rewritten in
place with the real row count. No output is read back or copied.

Resuming: a day is written under ``*.partial`` names and renamed when complete, so a day whose
files all exist is finished: a re-run skips it (checking it was made from the same input file, by
name and size, with the same options) and redoes only the others. The first pass of
``--frequency-threshold`` resumes the same way (per file's id counts, then the saved vocabularies).

Memory per worker: a few chunks (``--block-mib``) plus the distinct ids of its file. With
``--frequency-threshold`` the main process also holds one feature's distinct ids over all files
with their counts while merging (as TorchRec's own contiguous preprocessing does).
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing
import os
import queue
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from app.data import tsv
from app.data.tsv import CriteoArrays, expand_paths

NUM_DENSE = tsv.NUM_DENSE
NUM_SPARSE = tsv.NUM_SPARSE
# Modulo 2**32 keeps the 32-bit hashed ids as they are: the raw ids.
RAW_IDS = [2**32] * NUM_SPARSE
# A (feature, id) pair as one int64 key, feature in the high bits: one np.unique covers all 26.
FEATURE_OFFSETS = np.arange(NUM_SPARSE, dtype=np.int64) << 32
# Contiguous ids (TorchRec): 1 for rare or unseen ids, 2 for the first vocabulary entry.
RARE_ID = 1
FIRST_CONTIGUOUS_ID = 2
# Bytes of text parsed per chunk: the chunk's parsed arrays and temporaries are a few times this.
DEFAULT_BLOCK_MIB = 8
DENSE_TRANSFORMS = ("log1p", "log_plus_3")
# Bump when the output layout changes, so that a re-run does not mix old and new days.
FORMAT_VERSION = 1


@dataclass(frozen=True)
class Config:
    """What to preprocess and how (the command-line options)."""

    inputs: list[str]
    output: Path
    workers: int = 1
    frequency_threshold: int = 0
    vocabulary: Path | None = None
    dense_transform: str = "log1p"
    on_bad_rows: str = "error"
    block_mib: int = DEFAULT_BLOCK_MIB
    progress: bool = True


@dataclass(frozen=True)
class DayTask:
    """One input file and where its day goes; sent to a worker process."""

    day: int
    input: Path
    output: Path
    dense_transform: str
    on_bad_rows: str
    block_bytes: int
    vocabulary_dir: Path | None  # where vocab_feature_j.npy are, or None for raw ids
    signature: dict[str, Any] = field(default_factory=dict)  # what makes two runs' days alike

    def path(self, part: str) -> Path:
        """``day_N_<part>`` in the output folder, e.g. ``part="dense.npy"``."""
        return self.output / f"day_{self.day}_{part}"


@dataclass
class DayResult:
    """What a worker reports about a day it converted."""

    day: int
    rows: int
    busy_seconds: float


# ----------------------------------------------------------------------------------------------
# Reading raw TSV in chunks
# ----------------------------------------------------------------------------------------------


def iter_chunks(
    path: Path, dense_transform: str, on_bad_rows: str, block_bytes: int
) -> Iterator[tuple[CriteoArrays, int]]:
    """``(rows with raw ids, number of bad rows skipped)`` per chunk of about ``block_bytes`` of a raw
    TSV file (plain or gzip), streamed by ``app.data.tsv.iter_tsv_chunks``.

    The reader parses blocks of ``tsv.CHUNK_BYTES`` (its cache-friendly size); consecutive blocks
    are joined here into larger chunks, so that the per-chunk work (np.unique, three writes, a
    progress message) is not paid per small block.
    """
    streaming = getattr(tsv, "iter_tsv_chunks", None)
    if streaming is None:
        blocks = _whole_file(path, dense_transform, on_bad_rows)
    else:
        blocks = streaming(
            path, RAW_IDS, None, block_bytes=tsv.CHUNK_BYTES, on_bad_rows=on_bad_rows, dense_transform=dense_transform
        )
    blocks_per_chunk = max(1, block_bytes // tsv.CHUNK_BYTES)
    group: list[CriteoArrays] = []
    skipped = 0
    for arrays, skipped_here in blocks:
        group.append(arrays)
        skipped += skipped_here
        if len(group) == blocks_per_chunk:
            yield CriteoArrays.concat(group), skipped
            group, skipped = [], 0
    if group:
        yield CriteoArrays.concat(group), skipped


def _whole_file(path: Path, dense_transform: str, on_bad_rows: str) -> Iterator[tuple[CriteoArrays, int]]:
    """For an ``app.data.tsv`` without ``iter_tsv_chunks``: the whole file in one piece, so memory is
    NOT bounded by the chunk size there; only the reader's default options are offered."""
    if dense_transform != "log1p" or on_bad_rows != "error":
        raise ValueError(
            f"--dense-transform {dense_transform} --on-bad-rows {on_bad_rows}: this app/data/tsv.py has no "
            "iter_tsv_chunks; only --dense-transform log1p with --on-bad-rows error can be read"
        )
    arrays = tsv.read_tsv(path, RAW_IDS)
    yield arrays, 0


# ----------------------------------------------------------------------------------------------
# Exact id counts, merged from per-chunk np.unique
# ----------------------------------------------------------------------------------------------


class IdCounter:
    """Every distinct (feature, raw id) pair seen, with how often: exact, in sorted int64 keys.

    Chunks are reduced with np.unique and merged into the total only once the pending ones hold as
    many keys as the total, so each key is re-sorted a logarithmic number of times, not per chunk.
    """

    MIN_MERGE_KEYS = 1 << 22

    def __init__(self) -> None:
        self.keys = np.empty(0, dtype=np.int64)
        self.counts = np.empty(0, dtype=np.int64)
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []
        self._pending_keys = 0

    def add_ids(self, ids: np.ndarray) -> None:
        """Count a chunk of raw ids, int64 (rows, 26) in [0, 2**32)."""
        keys, counts = np.unique((ids + FEATURE_OFFSETS).ravel(), return_counts=True)
        self.add_counts(keys, counts)

    def add_counts(self, keys: np.ndarray, counts: np.ndarray) -> None:
        """Add sorted unique keys with their counts (e.g. another counter's)."""
        self._pending.append((keys, counts.astype(np.int64, copy=False)))
        self._pending_keys += keys.size
        if self._pending_keys >= max(self.keys.size, self.MIN_MERGE_KEYS):
            self.merge()

    def merge(self) -> "IdCounter":
        """Fold the pending chunks into ``keys``/``counts``; returns self."""
        if not self._pending:
            return self
        keys = np.concatenate([self.keys] + [k for k, _ in self._pending])
        counts = np.concatenate([self.counts] + [c for _, c in self._pending])
        self._pending, self._pending_keys = [], 0
        order = np.argsort(keys, kind="stable")
        keys, counts = keys[order], counts[order]
        starts = np.flatnonzero(np.concatenate(([True], keys[1:] != keys[:-1])))
        self.keys, self.counts = keys[starts], np.add.reduceat(counts, starts) if keys.size else counts
        return self

    def per_feature(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """``(sorted raw ids int64, counts)`` of each of the 26 features."""
        self.merge()
        bounds = np.searchsorted(self.keys, np.append(FEATURE_OFFSETS, np.int64(NUM_SPARSE) << 32))
        return [
            (self.keys[a:b] - FEATURE_OFFSETS[j], self.counts[a:b])
            for j, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))
        ]


# ----------------------------------------------------------------------------------------------
# Streaming .npy writer
# ----------------------------------------------------------------------------------------------


class NpyStreamWriter:
    """A .npy file written chunk by chunk under ``<name>.partial``; ``commit`` renames it.

    The header is written for zero rows first and rewritten with the real count at the end: NumPy
    pads headers so that the first dimension can grow to 21 digits in place.
    """

    def __init__(self, path: Path, dtype: np.dtype, row_shape: tuple[int, ...]) -> None:
        self.path = path
        self.partial = Path(f"{path}.partial")
        self.dtype = np.dtype(dtype)
        self.row_shape = row_shape
        self.rows = 0
        self._file = open(self.partial, "wb")
        self._header_bytes = self._file.write(self._header(0))

    def _header(self, rows: int) -> bytes:
        header = io.BytesIO()
        descr = np.lib.format.dtype_to_descr(self.dtype)
        fields = {"descr": descr, "fortran_order": False, "shape": (rows, *self.row_shape)}
        np.lib.format.write_array_header_1_0(header, fields)
        return header.getvalue()

    def write(self, rows: np.ndarray) -> None:
        """Append rows of shape (n, *row_shape), converted to the file's dtype."""
        rows = np.ascontiguousarray(rows, dtype=self.dtype).reshape(-1, *self.row_shape)
        if rows.size:  # (a memoryview of zero rows cannot be cast to bytes)
            self._file.write(memoryview(rows).cast("B"))
        self.rows += rows.shape[0]

    def finish(self) -> None:
        """Write the final header and close the file (still under its .partial name)."""
        header = self._header(self.rows)
        if len(header) != self._header_bytes:  # cannot happen below 10**21 rows; never write a corrupt file
            raise RuntimeError(f"{self.partial}: the .npy header changed length; cannot patch it in place")
        self._file.seek(0)
        self._file.write(header)
        self._file.close()

    def commit(self) -> None:
        os.replace(self.partial, self.path)

    def abort(self) -> None:
        self._file.close()
        self.partial.unlink(missing_ok=True)


# ----------------------------------------------------------------------------------------------
# Vocabularies (--frequency-threshold, --vocabulary)
# ----------------------------------------------------------------------------------------------


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
        _save_npy_atomically(vocabulary_path(folder, j), kept)
        sizes.append(int(kept.size))
    _write_json_atomically(folder / "vocabulary.json", dict(description, sizes=sizes))
    return sizes


# ----------------------------------------------------------------------------------------------
# Workers
# ----------------------------------------------------------------------------------------------

# Where a worker reports parsed rows: the main process's progress queue, or a callback when the
# work runs in the main process itself.
_report_rows: Callable[[int], None] = lambda rows: None


def _init_worker(progress: multiprocessing.Queue) -> None:
    global _report_rows
    _report_rows = progress.put


def count_ids(task: DayTask) -> DayResult:
    """First pass of ``--frequency-threshold``: every id of one file with its count, saved as
    ``day_N_id_counts.npz`` (files, not pickles through a pipe: a Terabyte day has ~10**8 ids)."""
    started = time.perf_counter()
    counter, rows = IdCounter(), 0
    for arrays, _ in iter_chunks(task.input, task.dense_transform, task.on_bad_rows, task.block_bytes):
        counter.add_ids(arrays.sparse)
        rows += len(arrays)
        _report_rows(len(arrays))
    members = {}
    for j, (ids, counts) in enumerate(counter.per_feature()):
        members[f"ids_{j}"], members[f"counts_{j}"] = ids.astype(np.uint32), counts
    _save_npz_atomically(task.path("id_counts.npz"), info=np.array(json.dumps(_input_info(task))), **members)
    return DayResult(task.day, rows, time.perf_counter() - started)


def _input_info(task: DayTask) -> dict[str, Any]:
    """What identifies a day's input file (and the reading options) in its sidecar files."""
    return {"input": str(task.input), "input_bytes": task.input.stat().st_size, "on_bad_rows": task.on_bad_rows}


def convert_day(task: DayTask) -> DayResult:
    """Write one input file as day ``task.day``: three .npy files and the stats, renamed when complete."""
    started = time.perf_counter()
    vocabularies = load_vocabularies(task.vocabulary_dir) if task.vocabulary_dir else None
    writers = [
        NpyStreamWriter(task.path("dense.npy"), np.float32, (NUM_DENSE,)),
        NpyStreamWriter(task.path("sparse.npy"), np.int64, (NUM_SPARSE,)),
        NpyStreamWriter(task.path("labels.npy"), np.int32, (1,)),
    ]
    counter, positives, skipped, labelled, first_bad_row = IdCounter(), 0, 0, True, None
    try:
        for arrays, skipped_here in iter_chunks(task.input, task.dense_transform, task.on_bad_rows, task.block_bytes):
            counter.add_ids(arrays.sparse)
            sparse = arrays.sparse if vocabularies is None else map_to_contiguous(arrays.sparse, vocabularies)
            for writer, part in zip(writers, (arrays.dense, sparse, arrays.labels)):
                writer.write(part)
            positives += int(np.count_nonzero(arrays.labels == 1))
            labelled = labelled and not (len(arrays) and arrays.labels[0] == -1)
            skipped += int(skipped_here)
            first_bad_row = first_bad_row or getattr(arrays, "first_bad_row", None)
            _report_rows(len(arrays))
        for writer in writers:
            writer.finish()
        stats = dict(rows=writers[0].rows, positives=positives, skipped_rows=skipped, labelled=labelled,
                     first_bad_row=first_bad_row)
        _save_day_stats(task, stats, counter)
        for writer in writers:  # the stats first: a day whose three .npy files exist has its stats
            writer.commit()
    except BaseException:
        for writer in writers:
            writer.abort()
        raise
    return DayResult(task.day, writers[0].rows, time.perf_counter() - started)


def _save_day_stats(task: DayTask, stats: dict, counter: IdCounter) -> None:
    """The day's counts and its distinct raw ids per feature (uint32: raw ids are below 2**32),
    kept so that metadata.json can count distinct ids over all days, also after a resumed run."""
    unique = [ids.astype(np.uint32) for ids, _ in counter.per_feature()]
    info = dict(stats, **_input_info(task), signature=task.signature, distinct_ids_per_feature=[u.size for u in unique])
    members = {f"unique_{j}": ids for j, ids in enumerate(unique)}
    _save_npz_atomically(task.path("stats.npz"), info=np.array(json.dumps(info)), **members)


def read_sidecar_info(path: Path) -> dict[str, Any]:
    """The info dict of a day's stats or id-counts sidecar."""
    with np.load(path, allow_pickle=False) as sidecar:
        return json.loads(sidecar["info"].item())


# ----------------------------------------------------------------------------------------------
# Running tasks in parallel with one progress bar
# ----------------------------------------------------------------------------------------------


def run_tasks(function: Callable, tasks: Sequence[DayTask], workers: int, description: str, progress: bool) -> list:
    """``function(task)`` for every task, in task order; spawned worker processes when ``workers`` > 1."""
    global _report_rows
    if not tasks:
        return []
    bar = tqdm(desc=description, unit=" rows", unit_scale=True, mininterval=1.0, disable=not progress, file=sys.stderr)
    try:
        if workers <= 1 or len(tasks) <= 1:
            _report_rows = bar.update
            try:
                return [function(task) for task in tasks]
            finally:
                _report_rows = lambda rows: None
        return _run_in_pool(function, tasks, workers, bar)
    finally:
        bar.close()


def _run_in_pool(function: Callable, tasks: Sequence[DayTask], workers: int, bar: tqdm) -> list:
    context = multiprocessing.get_context("spawn")  # fork would copy the parent's threads and memory
    progress = context.Queue()
    with ProcessPoolExecutor(min(workers, len(tasks)), context, _init_worker, (progress,)) as pool:
        futures = [pool.submit(function, task) for task in tasks]
        pending = set(futures)
        try:
            while pending:
                done, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
                _drain(progress, bar)
                for future in done:
                    future.result()  # a worker's error stops the run now
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        _drain(progress, bar)
        return [future.result() for future in futures]


def _drain(progress: multiprocessing.Queue, bar: tqdm) -> None:
    while True:
        try:
            bar.update(progress.get_nowait())
        except queue.Empty:
            return


# ----------------------------------------------------------------------------------------------
# The whole run
# ----------------------------------------------------------------------------------------------


def run(config: Config) -> dict[str, Any]:
    """Preprocess ``config.inputs`` into ``config.output``; returns the metadata written."""
    started = time.perf_counter()
    _check_config(config)
    inputs = expand_paths(config.inputs)
    config.output.mkdir(parents=True, exist_ok=True)
    vocabulary = _prepare_vocabulary(config, inputs)
    signature = _signature(config, vocabulary)
    tasks = [
        DayTask(day, path, config.output, config.dense_transform, config.on_bad_rows,
                config.block_mib << 20, vocabulary["dir"] if vocabulary else None, signature)
        for day, path in enumerate(inputs)
    ]
    _warn_about_other_days(config.output, len(tasks))
    todo = [task for task in tasks if not _already_done(task)]
    results = run_tasks(convert_day, todo, config.workers, "converting", config.progress)
    metadata = build_metadata(config, tasks, vocabulary)
    _write_json_atomically(config.output / "metadata.json", metadata)
    _print_summary(results, len(tasks), config.workers, time.perf_counter() - started, config.output)
    return metadata


def _check_config(config: Config) -> None:
    if config.workers < 1:
        raise ValueError(f"--workers {config.workers}: must be at least 1")
    if config.frequency_threshold < 0:
        raise ValueError(f"--frequency-threshold {config.frequency_threshold}: must be >= 0 (0 = raw ids)")
    if config.vocabulary is not None and config.frequency_threshold:
        raise ValueError(
            "--vocabulary and --frequency-threshold exclude each other: the vocabulary already applies its threshold"
        )
    if config.dense_transform not in DENSE_TRANSFORMS:
        raise ValueError(f"--dense-transform {config.dense_transform}: expected one of {', '.join(DENSE_TRANSFORMS)}")
    if config.on_bad_rows not in ("error", "skip"):
        raise ValueError(f"--on-bad-rows {config.on_bad_rows}: expected error or skip")
    if config.block_mib < 1:
        raise ValueError(f"--block-mib {config.block_mib}: must be at least 1")


def _describe_inputs(inputs: Sequence[Path]) -> list[dict[str, Any]]:
    return [{"name": path.name, "path": str(path), "bytes": path.stat().st_size} for path in inputs]


def _prepare_vocabulary(config: Config, inputs: Sequence[Path]) -> dict[str, Any] | None:
    """The vocabulary to map ids with: None (raw ids), a given one, or one counted now (or saved by
    an earlier run over the same inputs with the same threshold)."""
    if config.vocabulary is not None:
        description = _read_json(config.vocabulary / "vocabulary.json")
        load_vocabularies(config.vocabulary)  # fail now, naming a missing file, not in every worker
        return dict(description, dir=config.vocabulary)
    if not config.frequency_threshold:
        return None
    # Inputs by name and size, not path: a re-run from another folder is the same run.
    described = [{"name": path.name, "bytes": path.stat().st_size} for path in inputs]
    description = {"threshold": config.frequency_threshold, "inputs": described}
    saved = config.output / "vocabulary.json"
    if saved.is_file():
        previous = _read_json(saved)
        if {k: previous.get(k) for k in description} != description:
            # Never overwrite it: days already written there were mapped with it.
            raise ValueError(
                f"{saved}: made with threshold {previous.get('threshold')} from other inputs or with another "
                f"threshold than --frequency-threshold {config.frequency_threshold} now; use a new --output folder"
            )
        print(f"reusing the vocabularies in {config.output} (same inputs and threshold)", file=sys.stderr)
        return dict(previous, dir=config.output)
    tasks = [DayTask(i, p, config.output, config.dense_transform, config.on_bad_rows, config.block_mib << 20, None)
             for i, p in enumerate(inputs)]
    todo = [task for task in tasks if not _counted_already(task)]
    run_tasks(count_ids, todo, config.workers, "counting ids", config.progress)
    count_files = [task.path("id_counts.npz") for task in tasks]
    sizes = _save_vocabularies(config.output, count_files, config.frequency_threshold, description)
    for path in count_files:  # the vocabulary replaces them
        path.unlink()
    return dict(description, sizes=sizes, dir=config.output)


def _counted_already(task: DayTask) -> bool:
    """Whether an interrupted earlier run left this input's id counts (first pass) complete."""
    path = task.path("id_counts.npz")
    identity = ("input_bytes", "on_bad_rows")
    if not path.is_file():
        return False
    info, current = read_sidecar_info(path), _input_info(task)
    if Path(info["input"]).name == task.input.name and all(info[k] == current[k] for k in identity):
        print(f"day {task.day}: ids already counted ({task.input.name})", file=sys.stderr)
        return True
    return False


def _signature(config: Config, vocabulary: dict[str, Any] | None) -> dict[str, Any]:
    """What a day's content depends on besides its input file: equal signatures, equal days."""
    return {
        "format_version": FORMAT_VERSION,
        "dense_transform": config.dense_transform,
        "frequency_threshold": vocabulary["threshold"] if vocabulary else 0,
        "vocabulary_sizes": vocabulary["sizes"] if vocabulary else None,
    }


def _warn_about_other_days(output: Path, num_days: int) -> None:
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


def _already_done(task: DayTask) -> bool:
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


# ----------------------------------------------------------------------------------------------
# Small file helpers
# ----------------------------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: missing") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None


def _write_json_atomically(path: Path, value: dict[str, Any]) -> None:
    partial = Path(f"{path}.partial")
    partial.write_text(json.dumps(value, indent=2, default=str) + "\n")
    os.replace(partial, path)


def _save_npz_atomically(path: Path, **arrays: np.ndarray) -> None:
    partial = Path(f"{path}.partial")
    with open(partial, "wb") as file:  # np.savez appends ".npz" to a file name, not to an open file
        np.savez(file, **arrays)
    os.replace(partial, path)


def _save_npy_atomically(path: Path, array: np.ndarray) -> None:
    partial = Path(f"{path}.partial")
    with open(partial, "wb") as file:
        np.lib.format.write_array(file, array, allow_pickle=False)
    os.replace(partial, path)


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


def default_workers() -> int:
    """The cores this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m app.preprocess",
        description=__doc__.split("\nStreaming:")[0],  # what it writes, with examples
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Re-running with the same inputs and output skips the days already complete.",
    )
    parser.add_argument("--input", nargs="+", required=True, metavar="FILE",
                        help="raw TSV files, globs or folders (of *.tsv/*.txt), in day order; .gz is read as gzip")
    parser.add_argument("--output", required=True, type=Path, metavar="DIR",
                        help="folder to write the days to (created if needed)")
    parser.add_argument("--workers", type=int, default=default_workers(),
                        help="processes converting files in parallel, one file each "
                        "(default: the cores here, %(default)s)")
    parser.add_argument("--frequency-threshold", type=int, default=0, metavar="T",
                        help="0 (default): keep the raw 32-bit ids. T >= 1: count ids over all inputs first, then "
                        "write contiguous ids: ids seen >= T times -> 2, 3, ... (sorted by raw id), others -> 1; the "
                        "vocabularies are saved as vocab_feature_j.npy. T = 1 gives contiguous ids for every id seen.")
    parser.add_argument("--vocabulary", type=Path, default=None, metavar="DIR",
                        help="map ids with the vocabularies saved in DIR by an earlier run (e.g. the training days), "
                        "so that these days use the same contiguous ids; ids not in them -> 1")
    parser.add_argument("--dense-transform", choices=DENSE_TRANSFORMS, default="log1p",
                        help="log1p: log(max(x, 0) + 1) (default, facebookresearch/dlrm); log_plus_3: TorchRec's "
                        "former log(x + 3), x clamped to >= -2. Recorded in metadata.json.")
    parser.add_argument("--on-bad-rows", choices=("error", "skip"), default="error",
                        help="error (default): stop at the first malformed row, naming file and line; skip: leave "
                        "such rows out and count them in metadata.json")
    parser.add_argument("--block-mib", type=int, default=DEFAULT_BLOCK_MIB,
                        help="MiB of text parsed per chunk (default %(default)s); "
                        "memory per worker is a few times this")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m app.preprocess``; returns the exit status (2 for a bad input)."""
    args = build_parser().parse_args(argv)
    config = Config(
        inputs=list(args.input),
        output=args.output,
        workers=args.workers,
        frequency_threshold=args.frequency_threshold,
        vocabulary=args.vocabulary,
        dense_transform=args.dense_transform,
        on_bad_rows=args.on_bad_rows,
        block_mib=args.block_mib,
        progress=args.progress,
    )
    try:
        run(config)
    except (ValueError, FileNotFoundError) as error:  # CriteoFormatError is a ValueError
        if os.environ.get("APP_TRACEBACK"):
            raise
        print(f"error: {error}\n(set APP_TRACEBACK=1 to see the traceback)", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    # Run as the importable module, so that worker processes unpickle app.preprocess.* functions.
    from app.preprocess import main as _main

    raise SystemExit(_main())
