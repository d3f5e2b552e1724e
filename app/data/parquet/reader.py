"""Parquet files as chunks of model-ready rows: the label, the dense features transformed and the
categorical ids as 32-bit raw ids, the form the cache's NumPy days store (``app/data/preprocess/day.py``).

Row groups are streamed with pyarrow's ``ParquetFile.iter_batches`` (only the schema's columns, a
bounded number of rows at a time), so memory stays bounded whatever the file size. Whatever a file
holds that the schema cannot use stops the conversion with one line naming the file, the column and
the row group.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from app.criteo import NUM_DENSE, NUM_SPARSE
from app.data.parquet.schema import CategoricalColumn, DenseColumn, ParquetSchema
from app.data.tsv import CriteoArrays

@dataclass
class GroupedArrays(CriteoArrays):
    """Rows with each row's group id (int64), for GAUC (the schema's group column), and the list
    columns' ids: feature index -> (ids per row int32 (rows,), the ids uint32 in row order)."""

    groups: np.ndarray | None = None
    lists: dict[int, tuple[np.ndarray, np.ndarray]] | None = None
    truncated_rows: int = 0  # rows whose list was longer than its max_length, cut


GROUPS_FILE = "groups.npy"  # day_N_groups.npy beside a day's files, with the schema's group column
LIST_LENGTHS_FILE = "list_{}_lengths.npy"  # day_N_list_<feature index>_lengths.npy: ids per row, int32
LIST_IDS_FILE = "list_{}_ids.npy"  # day_N_list_<feature index>_ids.npy: the rows' ids one after another, int32
BYTES_PER_ROW_ESTIMATE = 256  # chunk rows = the preprocessor's block bytes / this
_FNV_OFFSET = np.uint64(0xCBF29CE484222325)
_FNV_PRIME = np.uint64(0x100000001B3)
_HEX_DIGITS = np.full(256, 255, dtype=np.uint8)
_HEX_DIGITS[np.frombuffer(b"0123456789", np.uint8)] = np.arange(10, dtype=np.uint8)
_HEX_DIGITS[np.frombuffer(b"abcdef", np.uint8)] = np.arange(10, 16, dtype=np.uint8)
_HEX_DIGITS[np.frombuffer(b"ABCDEF", np.uint8)] = np.arange(10, 16, dtype=np.uint8)


def open_parquet(path: Path, read_dictionary: list[str] | None = None) -> pq.ParquetFile:
    """The file, refused with its name when it is not Parquet or holds no row group. The columns of
    ``read_dictionary`` come as dictionary arrays: each distinct string decoded once (3x faster for ids)."""
    try:
        file = pq.ParquetFile(path, read_dictionary=read_dictionary)
    except (pa.ArrowInvalid, OSError) as error:
        raise ValueError(f"{path}: not a readable Parquet file ({error})") from None
    if file.metadata.num_row_groups == 0 or file.metadata.num_rows == 0:
        raise ValueError(f"{path}: the Parquet file holds no rows (row groups: {file.metadata.num_row_groups})")
    return file


def check_columns(path: Path, file: pq.ParquetFile, schema: ParquetSchema) -> bool:
    """Checks that the file has every feature column, of a usable type; returns whether it has the label."""
    types = {field.name: field.type for field in file.schema_arrow}
    for column in schema.dense:
        _check_type(path, column.name, types, "numbers", lambda t: pa.types.is_integer(t) or pa.types.is_floating(t))
    for column in schema.categorical:
        wanted = "integers" if column.ids == "integer" else "strings"
        is_usable = pa.types.is_integer if column.ids == "integer" else _is_string
        if column.max_length:
            wanted, single = f"lists of {wanted} (max_length {column.max_length})", is_usable
            is_usable = lambda t, single=single: _is_list(t) and single(t.value_type)  # noqa: E731
        _check_type(path, column.name, types, wanted, is_usable)
    if schema.group is not None:
        _check_type(path, schema.group, types, "group ids (integers or strings)", lambda t: pa.types.is_integer(t) or _is_string(t))
    if schema.label not in types:
        return False
    _check_type(path, schema.label, types, "0/1 labels", lambda t: pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t))
    return True


def _is_list(arrow_type: pa.DataType) -> bool:
    return pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type)


def _is_string(arrow_type: pa.DataType) -> bool:
    if pa.types.is_dictionary(arrow_type):
        arrow_type = arrow_type.value_type
    return pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type)


def _check_type(path: Path, name: str, types: dict[str, pa.DataType], wanted: str, usable: Any) -> None:
    if name not in types:
        raise ValueError(f"{path}: column {name!r} of data.schema is missing (the file has {', '.join(types)})")
    if not usable(types[name]):
        raise ValueError(f"{path}: column {name!r} holds {types[name]}; data.schema declares {wanted}")


def iter_parquet_chunks(
    path: Path, schema: ParquetSchema, block_bytes: int, statistics: dict[str, list[float]] | None = None
) -> Iterator[tuple[CriteoArrays, int]]:
    """``(rows with raw 32-bit ids, 0 rows skipped)`` per chunk of a Parquet file, row group by row group.
    ``statistics``: [mean, std] of each ``standardize`` dense column over the training rows."""
    strings = [c.name for c in schema.categorical if c.ids != "integer" and not c.max_length]
    strings += [] if schema.group is None else [schema.group]
    labelled = check_columns(path, open_parquet(path), schema)
    file = open_parquet(path, read_dictionary=strings)  # once the columns are known to be there
    columns = [c.name for c in schema.dense] + [c.name for c in schema.categorical] + ([schema.label] if labelled else [])
    columns += [] if schema.group is None else [schema.group]
    chunk_rows = max(1, block_bytes // BYTES_PER_ROW_ESTIMATE)
    for group in range(file.metadata.num_row_groups):
        for batch in file.iter_batches(batch_size=chunk_rows, row_groups=[group], columns=columns):
            where = f"{path}: row group {group}"
            yield _arrays(batch, schema, labelled, where, statistics or {}), 0


def _arrays(
    batch: pa.RecordBatch, schema: ParquetSchema, labelled: bool, where: str, statistics: dict[str, list[float]]
) -> CriteoArrays:
    dense = np.zeros((batch.num_rows, NUM_DENSE), dtype=np.float32)  # inputs no column fills hold 0
    for j, column in enumerate(schema.dense):
        dense[:, j] = dense_values(batch.column(column.name), column, where, statistics.get(column.name))
    sparse = np.zeros((batch.num_rows, NUM_SPARSE), dtype=np.uint32)  # a list feature's column stays 0
    lists, truncated = {}, 0
    for j, column in enumerate(schema.categorical):
        if column.max_length:
            lengths, ids, cut = list_ids(batch.column(column.name), column, where)
            lists[j], truncated = (lengths, ids), truncated + cut
        else:
            sparse[:, j] = raw_ids(batch.column(column.name), column, where)
    labels = label_values(batch.column(schema.label), schema.label, where) if labelled else np.full(batch.num_rows, -1, np.float32)
    if schema.group is None and not lists:
        return CriteoArrays(dense, sparse.astype(np.int64), labels)
    groups = None if schema.group is None else group_ids(batch.column(schema.group), schema.group, where)
    return GroupedArrays(dense, sparse.astype(np.int64), labels, groups=groups, lists=lists, truncated_rows=truncated)


def list_ids(values: pa.Array, column: CategoricalColumn, where: str) -> tuple[np.ndarray, np.ndarray, int]:
    """A list column as (ids per row, at most max_length; the rows' first ids, uint32, in row order;
    how many rows were longer). A null list has no id."""
    lengths = pc.fill_null(pc.list_value_length(values), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    flat = pc.list_flatten(values)  # the ids of the non-null lists, row after row
    kept = np.minimum(lengths, column.max_length)
    row_starts = np.cumsum(lengths) - lengths
    within = np.arange(int(lengths.sum())) - np.repeat(row_starts, lengths)
    keep = within < np.repeat(kept, lengths)
    single = CategoricalColumn(column.name, column.ids)
    ids = raw_ids(flat.filter(pa.array(keep)), single, where) if keep.size else np.empty(0, np.uint32)
    return kept.astype(np.int32), ids, int(np.count_nonzero(lengths > kept))


def group_ids(values: pa.Array, name: str, where: str) -> np.ndarray:
    """Group ids as int64: integers as they are, strings by their 64-bit FNV-1a; nulls refused."""
    if values.null_count:
        raise ValueError(f"{where}: group column {name!r} has {values.null_count} null values")
    if pa.types.is_integer(values.type):
        return values.to_numpy(zero_copy_only=False).astype(np.int64)
    encoded = _dictionary(values)
    return fnv1a_64(encoded.dictionary.cast(pa.large_string())).view(np.int64)[encoded.indices.to_numpy(zero_copy_only=False)]


def _dictionary(values: pa.Array) -> pa.DictionaryArray:
    """Strings as distinct words and indices: as read (read_dictionary), or encoded here."""
    return values if pa.types.is_dictionary(values.type) else pc.dictionary_encode(values)


def label_values(values: pa.Array, name: str, where: str) -> np.ndarray:
    """The labels as float32 0/1; nulls and other values refused with how many and the first."""
    nulls = values.null_count
    if nulls:
        raise ValueError(f"{where}: label column {name!r} has {nulls} null values")
    labels = values.to_numpy(zero_copy_only=False).astype(np.float32)
    bad = (labels != 0) & (labels != 1)
    if bad.any():
        raise ValueError(
            f"{where}: label column {name!r} holds {int(bad.sum())} values other than 0 and 1 "
            f"(the first: {labels[bad][0]:g} at row {int(np.flatnonzero(bad)[0])} of the group)"
        )
    return labels


def dense_values(values: pa.Array, column: DenseColumn, where: str, statistics: list[float] | None = None) -> np.ndarray:
    """One dense column as float32, nulls filled and the transform applied (float64 first, as for TSV);
    ``statistics``: the training rows' [mean, std], for ``standardize``."""
    numbers = dense_float64(values, column, where)
    if column.transform == "log1p":
        return np.log1p(np.maximum(numbers, 0.0)).astype(np.float32)
    if column.transform == "standardize":
        assert statistics is not None, f"{column.name}: standardize needs the training rows' mean and std"
        mean, std = statistics
        return ((numbers - mean) / std).astype(np.float32)
    return numbers.astype(np.float32)


def dense_float64(values: pa.Array, column: DenseColumn, where: str) -> np.ndarray:
    """One dense column as float64 with its nulls filled (refused without a fill), before its transform."""
    if values.null_count:
        if column.fill is None:
            raise ValueError(
                f"{where}: dense column {column.name!r} has {values.null_count} null values; "
                f"set its fill in data.schema.dense (e.g. fill: 0.0)"
            )
        values = values.fill_null(pa.scalar(column.fill).cast(values.type, safe=False))
    return values.to_numpy(zero_copy_only=False).astype(np.float64)


def raw_ids(values: pa.Array, column: CategoricalColumn, where: str) -> np.ndarray:
    """One categorical column as uint32 raw ids (null: id 0)."""
    if column.ids == "integer":
        ids = values.fill_null(0).to_numpy(zero_copy_only=False)
        bad = (ids < 0) | (ids > 0xFFFFFFFF)
        if bad.any():
            raise ValueError(
                f"{where}: column {column.name!r} holds {int(bad.sum())} ids outside 0 .. 2**32 - 1 (the first: "
                f"{ids[bad][0]}); declare it ids: string in data.schema.categorical to hash them"
            )
        return ids.astype(np.uint32)
    encoded = _dictionary(values)
    words = encoded.dictionary.cast(pa.large_string())
    distinct = hex_ids(words, column.name, where) if column.ids == "hex" else string_hashes(words)
    null = encoded.indices.is_null().to_numpy(zero_copy_only=False)
    ids = np.append(distinct, np.uint32(0))[encoded.indices.fill_null(len(distinct)).to_numpy(zero_copy_only=False)]
    ids[null] = 0
    return ids


def _bytes_and_offsets(words: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """The characters of a large_string array and each string's [start, end) in them."""
    offsets = np.frombuffer(words.buffers()[1], dtype=np.int64)[words.offset : words.offset + len(words) + 1]
    data = words.buffers()[2]
    characters = np.frombuffer(data, dtype=np.uint8) if data is not None else np.empty(0, np.uint8)
    return characters, offsets


def string_hashes(words: pa.Array) -> np.ndarray:
    """64-bit FNV-1a of each string's UTF-8 bytes, folded to 32 bits."""
    hashes = fnv1a_64(words)
    return ((hashes ^ (hashes >> np.uint64(32))) & np.uint64(0xFFFFFFFF)).astype(np.uint32)


def fnv1a_64(words: pa.Array) -> np.ndarray:
    """64-bit FNV-1a of each string's UTF-8 bytes (uint64), vectorised over the strings."""
    characters, offsets = _bytes_and_offsets(words)
    starts, lengths = offsets[:-1], np.diff(offsets)
    hashes = np.full(len(words), _FNV_OFFSET, dtype=np.uint64)
    for position in range(int(lengths.max(initial=0))):
        live = lengths > position
        byte = characters[starts[live] + position].astype(np.uint64)
        hashes[live] = (hashes[live] ^ byte) * _FNV_PRIME
    return hashes


def hex_ids(words: pa.Array, name: str, where: str) -> np.ndarray:
    """Each string of 1 to 8 hexadecimal digits as the number it writes; anything else refused."""
    characters, offsets = _bytes_and_offsets(words)
    starts, lengths = offsets[:-1], np.diff(offsets)
    bad = (lengths < 1) | (lengths > 8)
    values = np.zeros(len(words), dtype=np.uint64)
    for position in range(8):
        live = lengths > position
        digit = _HEX_DIGITS[characters[starts[live] + position]]
        bad[np.flatnonzero(live)[digit == 255]] = True
        values[live] = (values[live] << np.uint64(4)) | digit.astype(np.uint64)
    if bad.any():
        first = words[int(np.flatnonzero(bad)[0])].as_py()
        raise ValueError(f"{where}: column {name!r} holds {first!r}, not 1 to 8 hexadecimal digits (ids: hex)")
    return values.astype(np.uint32)
