"""``data.frequency_threshold`` on the cache path: the vocabulary counted over the cached training
rows, and cached days mapped with it (docs/data.md).

Raw TSV is cached with its raw ids first (:mod:`app.data.cache`: the same folder whatever the
threshold, so changing T parses nothing again). Then, beside it in the cache folder:

* the vocabulary, ``<training days>-vocabulary-t<T>[-<part>]``: every id of the training split's
  rows counted (only those rows: with ``data.split: kaggle`` days 0-5 of train.txt, not its test
  and validation halves of day 6), the ids seen >= T times kept (:class:`Vocabulary`);
* each split's days mapped with it, ``<days>-ids-<the vocabulary's SHA-256, 12 digits>``: contiguous
  ids in ``day_N_sparse.npy`` (2, 3, ... for kept ids, 1 for the others, the preprocessor's
  ``--frequency_threshold`` convention), dense features and labels hard-linked from the raw days
  (copied where the file system has no links). Another vocabulary maps into another folder. Its
  ``metadata.json`` also counts, per row range, the ids outside the vocabulary
  (:mod:`app.data.vocabulary_coverage`: what evaluating those rows reports).

Both follow the cache's protocol (:func:`app.data.cache.cached_folder`): a fingerprint (the raw
days' inputs and options; the threshold and row part, or the vocabulary's SHA-256), a lock, a
recorded failure for the ranks that wait. Both run on worker processes over row ranges of the
cached days, so a single large file (Kaggle's train.txt) is counted and mapped in parallel.

Memory per worker: one chunk of rows (:data:`ROWS_PER_CHUNK` x 26 ids, a few times 27 MB) plus its
row range's distinct ids when counting; merging holds one feature's distinct ids with their counts
(as :mod:`app.data.preprocess` does). Mapping memory-maps the vocabulary: 8 bytes per kept id, shared.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from app.criteo import NUM_SPARSE
from app.data.cache import CacheRequest, cached_days, cached_folder, read_metadata
from app.data.numpy_days import NumpyDaysSource, day_paths, ids_as_int64
from app.data.preprocess import (
    RAW_IDS,
    IdCounter,
    Vocabulary,
    default_workers,
    load_vocabularies,
    map_to_contiguous,
    run_tasks,
    save_vocabularies,
)
from app.data.preprocess.files import link_or_copy, partial_path, save_npz_atomically, write_json_atomically
from app.data.preprocess.workers import report_rows
from app.data.splits import RowPart, part_rows
from app.data.vocabulary_coverage import METADATA_KEY, count_mapped, row_cuts, to_metadata

SETTING = "data.frequency_threshold"
# A worker's task: at most this many rows of one day (Kaggle's one file is counted in parallel too).
ROWS_PER_TASK = 1 << 22
# Rows read, counted or mapped at once: (rows, 26) int64 ids are 27 MB at this size.
ROWS_PER_CHUNK = 1 << 17


@dataclass(frozen=True)
class RowRange:
    """Rows ``[start, stop)`` of one cached day (its path prefix ``.../day_N``): one worker's task.

    output: the file the task writes (its id counts, or the mapped ids' file to fill in), or reads
        (a day mapped before, whose ids outside the vocabulary are counted).
    vocabulary: the vocabulary folder to map with (mapping tasks only).
    """

    prefix: Path
    start: int
    stop: int
    output: Path
    vocabulary: Path | None = None


def training_vocabulary(
    days: CacheRequest, part: RowPart, threshold: int, setting_where: str, convert: bool = True
) -> Vocabulary:
    """The vocabulary of the ids seen >= ``threshold`` times in rows ``part`` of the cached ``days``
    (the training split's), counted first if needed (and ``convert``). A complete vocabulary is read
    without its raw days: evaluating later needs the training TSV's files, not their cache."""
    raw = days.folder
    folder = raw.with_name(f"{raw.name}-vocabulary-t{threshold}" + ("" if part == "all" else f"-{part}"))
    fingerprint = {"days": days.fingerprint(), "part": part, "threshold": threshold}

    def count(output: Path) -> None:
        _count_ids(cached_days(days), part, threshold, output, days.workers, setting_where)

    return Vocabulary.load(cached_folder(folder, fingerprint, count, convert, days.wait_s))


def mapped_days(days: CacheRequest, vocabulary: Vocabulary, convert: bool = True) -> Path:
    """The folder of the cached ``days`` with ids mapped by ``vocabulary``, made first if needed."""
    assert vocabulary.folder is not None, "a cache's vocabulary lives in a folder"
    raw = days.folder
    folder = raw.with_name(f"{raw.name}-ids-{vocabulary.sha256[:12]}")
    # The counts key: a folder mapped before its metadata counted the ids outside the vocabulary is mapped again.
    fingerprint = {"days": days.fingerprint(), "vocabulary_sha256": vocabulary.sha256, "counts": METADATA_KEY}

    def map_ids(output: Path) -> None:
        _map_days(cached_days(days), vocabulary, output, days.workers)

    return cached_folder(folder, fingerprint, map_ids, convert, days.wait_s)


# ---- counting ---------------------------------------------------------------------------------


def _count_ids(raw: Path, part: RowPart, threshold: int, output: Path, workers: int | None, setting_where: str) -> None:
    source = NumpyDaysSource.from_directory(raw, None, RAW_IDS)
    start, stop = part_rows(part, len(source))
    tasks = [
        RowRange(prefix, a, b, output / f"id_counts_{i}.npz")
        for i, (prefix, a, b) in enumerate(_row_ranges(source, start, stop))
    ]
    todo = [task for task in tasks if not task.output.is_file()]  # an interrupted count keeps what it finished
    run_tasks(count_row_range, todo, _workers(workers), "counting ids", sys.stderr.isatty())
    description = {"counted_over": {"days": str(raw), "part": part, "rows": stop - start}}
    save_vocabularies(output, [t.output for t in tasks], threshold, description, f"{SETTING} =", setting_where)
    for task in tasks:  # the vocabulary replaces them
        task.output.unlink()


def count_row_range(task: RowRange) -> int:
    """Every (feature, raw id) of the task's rows with its count, saved as ``ids_j``/``counts_j``
    (as the preprocessor's first pass saves a file's counts); returns the rows counted."""
    _, sparse_path, _ = day_paths(task.prefix)
    sparse = np.load(sparse_path, mmap_mode="r")
    counter = IdCounter()
    for a in range(task.start, task.stop, ROWS_PER_CHUNK):
        b = min(a + ROWS_PER_CHUNK, task.stop)
        counter.add_ids(ids_as_int64(sparse[a:b]))
        report_rows(b - a)
    save_npz_atomically(task.output, **counter.npz_members())
    return task.stop - task.start


# ---- mapping ----------------------------------------------------------------------------------


def _map_days(raw: Path, vocabulary: Vocabulary, output: Path, workers: int | None) -> None:
    metadata = read_metadata(raw)
    source = NumpyDaysSource.from_directory(raw, [day["day"] for day in metadata["days"]], RAW_IDS)
    cuts = row_cuts(len(source))  # so that any split's rows sum whole ranges' counts
    to_map, to_count, partials = [], [], []
    for day, (prefix, rows) in enumerate(zip(source.prefixes, source.rows_per_day.tolist())):
        dense, sparse, labels = day_paths(prefix)
        mapped_dense, mapped_sparse, mapped_labels = day_paths(output / prefix.name)
        link_or_copy(dense, mapped_dense)  # the same values: no bytes to write
        link_or_copy(labels, mapped_labels)
        day_start = int(source.day_starts[day])
        ranges = _row_ranges(source, day_start, day_start + rows, cuts)
        if mapped_sparse.is_file():  # mapped by an interrupted earlier attempt with this fingerprint: counted only
            to_count += [RowRange(prefix, a, b, mapped_sparse) for _, a, b in ranges]
            continue
        partial = partial_path(mapped_sparse)
        # Contiguous ids stay below 2**31: int32, like the raw days.
        np.lib.format.open_memmap(partial, mode="w+", dtype=np.int32, shape=(rows, NUM_SPARSE)).flush()
        partials.append((partial, mapped_sparse))
        to_map += [RowRange(prefix, a, b, partial, vocabulary.folder) for _, a, b in ranges]
    progress = sys.stderr.isatty()
    outside = run_tasks(map_row_range, to_map, _workers(workers), "mapping ids", progress)
    outside += run_tasks(count_mapped_range, to_count, _workers(workers), "counting ids outside the vocabulary",
                         progress)
    for partial, final in partials:
        partial.replace(final)
    day_starts = {prefix: int(start) for prefix, start in zip(source.prefixes, source.day_starts)}
    counted = sorted(
        (day_starts[task.prefix] + task.start, day_starts[task.prefix] + task.stop, counts)
        for task, counts in zip(to_map + to_count, outside)
    )
    write_json_atomically(output / "metadata.json", _mapped_metadata(metadata, vocabulary, counted))


def map_row_range(task: RowRange) -> list[int]:
    """Writes the contiguous ids of the task's rows into its (pre-sized) output file; returns, per
    feature, how many of the rows' ids are outside the vocabulary."""
    assert task.vocabulary is not None
    _, sparse_path, _ = day_paths(task.prefix)
    sparse = np.load(sparse_path, mmap_mode="r")
    mapped = np.load(task.output, mmap_mode="r+")
    vocabularies = load_vocabularies(task.vocabulary)
    outside = np.zeros(NUM_SPARSE, dtype=np.int64)
    for a in range(task.start, task.stop, ROWS_PER_CHUNK):
        b = min(a + ROWS_PER_CHUNK, task.stop)
        mapped[a:b] = map_to_contiguous(ids_as_int64(sparse[a:b]), vocabularies, outside_counts=outside)
        report_rows(b - a)
    mapped.flush()
    return outside.tolist()


def count_mapped_range(task: RowRange) -> list[int]:
    """Per feature, the task's rows' ids outside the vocabulary, read from its mapped file (``output``)."""
    mapped = np.load(task.output, mmap_mode="r")
    outside = np.zeros(NUM_SPARSE, dtype=np.int64)
    for a in range(task.start, task.stop, ROWS_PER_CHUNK):
        b = min(a + ROWS_PER_CHUNK, task.stop)
        outside += count_mapped(mapped[a:b])
        report_rows(b - a)
    return outside.tolist()


def _mapped_metadata(
    raw: dict[str, Any], vocabulary: Vocabulary, outside: Sequence[tuple[int, int, Sequence[int]]]
) -> dict[str, Any]:
    """The raw days' metadata.json (rows, labels, skipped rows, raw distinct ids), with the ids
    described as :mod:`app.data.preprocess` describes a ``--vocabulary`` run's, and the ids outside
    the vocabulary per row range (``outside``: first row, end row, counts per feature)."""
    return dict(
        raw,
        frequency_threshold=vocabulary.threshold,
        sparse_ids="contiguous",
        vocabulary_dir=str(vocabulary.folder),
        vocabulary_sha256=vocabulary.sha256,
        vocabulary_sizes=vocabulary.sizes,
        num_embeddings_per_feature=vocabulary.table_sizes,
        **{METADATA_KEY: to_metadata(outside)},
    )


# ---- shared -----------------------------------------------------------------------------------


def _row_ranges(
    source: NumpyDaysSource, start: int, stop: int, cuts: Sequence[int] = ()
) -> list[tuple[Path, int, int]]:
    """``[start, stop)`` of the concatenated days as ``(day prefix, first row, end row)`` pieces of at
    most :data:`ROWS_PER_TASK` rows, each within one day, also cut at ``cuts`` (rows of the
    concatenated days)."""
    pieces = []
    for day, prefix in enumerate(source.prefixes):
        first, end = int(source.day_starts[day]), int(source.day_starts[day + 1])
        a, b = max(start, first), min(stop, end)
        bounds = sorted({*range(a, b, ROWS_PER_TASK), *(cut for cut in cuts if a < cut < b), b}) if a < b else []
        pieces += [(prefix, s - first, e - first) for s, e in zip(bounds, bounds[1:])]
    return pieces


def _workers(workers: int | None) -> int:
    return default_workers() if workers is None else workers
