"""The key columns ``predict`` writes beside each probability (``data.schema.key_columns``): read
from the predict files, in row order, as text."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def check_key_columns(files: Sequence[Path], names: Sequence[str]) -> None:
    """Refuses a key column missing from a predict file, or holding lists (from the files' schemas alone)."""
    for path in files:
        types = {field.name: field.type for field in pq.read_schema(path)}
        for name in names:
            if name not in types:
                raise ValueError(f"{path}: key column {name!r} of data.schema.key_columns is missing (the file has {', '.join(types)})")
            if pa.types.is_nested(types[name]):
                raise ValueError(f"{path}: key column {name!r} holds {types[name]}; key columns hold one value a row")


def read_key_columns(files: Sequence[Path], names: Sequence[str]) -> dict[str, list[str]]:
    """Each key column's values over the files, in row order, as text (a null: empty); a value holding a
    tab or a line break is refused (predictions.tsv is tab-separated)."""
    columns: dict[str, list[str]] = {name: [] for name in names}
    for path in files:
        table = pq.read_table(path, columns=list(names))
        for name in names:
            values = ["" if value is None else str(value) for value in table.column(name).to_pylist()]
            bad = next((value for value in values if "\t" in value or "\n" in value or "\r" in value), None)
            if bad is not None:
                raise ValueError(f"{path}: key column {name!r} holds {bad!r}: a tab or line break cannot go in predictions.tsv")
            columns[name] += values
    return columns
