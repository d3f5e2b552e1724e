"""One input file -> one day: ``day_N_{dense,sparse,labels}.npy`` streamed chunk by chunk, and
``day_N_stats.npz`` with its counts and distinct raw ids, all renamed into place when complete."""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Iterator

import numpy as np

from app.criteo import NUM_DENSE, NUM_SPARSE
from app.data.parquet.reader import GROUPS_FILE, LIST_IDS_FILE, LIST_LENGTHS_FILE, iter_parquet_chunks
from app.data.parquet.schema import ParquetSchema
from app.data.preprocess.chunks import iter_chunks
from app.data.preprocess.config import DayResult, DayTask
from app.data.preprocess.files import NpyStreamWriter, save_npz_atomically
from app.data.preprocess.id_counts import DistinctIds
from app.data.preprocess.resume import input_info
from app.data.preprocess.vocabulary import load_vocabularies, map_to_contiguous
from app.data.preprocess.workers import report_rows
from app.data.tsv import CriteoArrays


def convert_day(task: DayTask) -> DayResult:
    """Write one input file as day ``task.day``: three .npy files and the stats, renamed when complete."""
    started = time.perf_counter()
    vocabularies = load_vocabularies(task.vocabulary_dir) if task.vocabulary_dir else None
    writers = [
        NpyStreamWriter(task.path("dense.npy"), np.float32, (NUM_DENSE,)),
        # int32: raw ids are 32-bit hashes (stored as their bits; readers take them as unsigned) and
        # contiguous ids stay below 2**31, so half of int64's bytes to write, cache and read.
        NpyStreamWriter(task.path("sparse.npy"), np.int32, (NUM_SPARSE,)),
        NpyStreamWriter(task.path("labels.npy"), np.int32, (1,)),
    ]
    # Parquet with a group column: each row's group id, for GAUC (read beside the days, not by the model).
    group_writer = NpyStreamWriter(task.path(GROUPS_FILE), np.int64, ()) if _has_groups(task) else None
    writers += [group_writer] if group_writer else []
    # Parquet list columns: each row's number of ids and the ids, row after row (a jagged feature).
    list_writers = {
        j: (NpyStreamWriter(task.path(LIST_LENGTHS_FILE.format(j)), np.int32, ()),
            NpyStreamWriter(task.path(LIST_IDS_FILE.format(j)), np.int32, ()))
        for j in _list_features(task)
    }  # fmt: skip
    writers += [writer for pair in list_writers.values() for writer in pair]
    truncated_rows = 0
    counter, positives, skipped, labelled, first_bad_row = DistinctIds(), 0, 0, True, None
    try:
        for arrays, skipped_here in _chunks(task):
            counter.add_ids(arrays.sparse)
            sparse = arrays.sparse if vocabularies is None else map_to_contiguous(arrays.sparse, vocabularies)
            for writer, part in zip(writers, (arrays.dense, sparse, arrays.labels)):
                writer.write(part)
            if group_writer is not None:
                group_writer.write(arrays.groups)
            for j, (lengths_writer, ids_writer) in list_writers.items():
                lengths_writer.write(arrays.lists[j][0])
                ids_writer.write(arrays.lists[j][1].view(np.int32))  # raw 32-bit ids, stored as their bits
                counter.add_feature_ids(j, arrays.lists[j][1])  # so that `auto` sizes the table by them too
            truncated_rows += getattr(arrays, "truncated_rows", 0)
            positives += int(np.count_nonzero(arrays.labels == 1))
            labelled = labelled and not (len(arrays) and arrays.labels[0] == -1)
            skipped += int(skipped_here)
            first_bad_row = first_bad_row or getattr(arrays, "first_bad_row", None)
            report_rows(len(arrays))
        for writer in writers:
            writer.finish()
        if truncated_rows:
            warnings.warn(f"{task.input}: {truncated_rows} lists longer than their data.schema max_length were cut to it",
                          stacklevel=1)  # fmt: skip
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


def _list_features(task: DayTask) -> list[int]:
    if task.parquet_schema is None:
        return []
    return [j for j, column in enumerate(task.parquet_schema["categorical"]) if column.get("max_length")]


def _has_groups(task: DayTask) -> bool:
    return task.parquet_schema is not None and task.parquet_schema.get("group") is not None


def _chunks(task: DayTask) -> Iterator[tuple[CriteoArrays, int]]:
    """The input's rows with raw ids, chunk by chunk: Parquet by the schema's columns, else raw TSV."""
    if task.parquet_schema is not None:
        schema = task.parquet_schema  # with the training rows' dense statistics, for standardize
        return iter_parquet_chunks(task.input, ParquetSchema.from_dict(schema), task.block_bytes, schema.get("dense_statistics"))
    return iter_chunks(task.input, task.dense_transform, task.on_bad_rows, task.block_bytes, task.num_threads)


def _save_day_stats(task: DayTask, stats: dict, counter: DistinctIds) -> None:
    """The day's counts and its distinct raw ids per feature (uint32: raw ids are below 2**32),
    kept so that metadata.json can count distinct ids over all days, also after a resumed run."""
    unique = counter.per_feature()
    info = dict(stats, **input_info(task), signature=task.signature, distinct_ids_per_feature=[u.size for u in unique])
    members = {f"unique_{j}": ids for j, ids in enumerate(unique)}
    save_npz_atomically(task.path("stats.npz"), info=np.array(json.dumps(info)), **members)
