"""``python -m app.data.to_parquet``: raw Criteo TSV -> Parquet with named columns and string ids.

The columns are ``label`` (int8; absent for unlabelled 39-field files), ``I1``..``I13`` (int64, null
where the field is empty) and ``C1``..``C26`` (strings: the ids' hexadecimal text, null where empty),
the default schema of ``data.format: parquet``; so the Criteo sample is also an example of one's own
data, and the two roads can be compared row for row. Streamed: memory holds one row group.

Usage::

    python -m app.data.to_parquet --input data/sample/train.tsv --output /tmp/criteo_parquet
"""

from __future__ import annotations

import gzip
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO

import pyarrow as pa
import pyarrow.parquet as pq

from app.criteo import DENSE_NAMES, NUM_DENSE, SPARSE_NAMES
from app.data.paths import expand_paths

FIELDS_LABELLED = 1 + NUM_DENSE + len(SPARSE_NAMES)
GZIP_MAGIC = b"\x1f\x8b"


def arrow_schema(labelled: bool) -> pa.Schema:
    """The Parquet files' columns: the label, the dense integers and the string ids."""
    fields = [pa.field("label", pa.int8())] if labelled else []
    fields += [pa.field(name, pa.int64()) for name in DENSE_NAMES]
    fields += [pa.field(name, pa.string()) for name in SPARSE_NAMES]
    return pa.schema(fields)


def _open_text(path: Path) -> IO[str]:
    with path.open("rb") as probe:
        magic = probe.read(2)
    if magic == GZIP_MAGIC:
        return gzip.open(path, "rt", encoding="ascii", newline="\n")
    return path.open("rt", encoding="ascii", newline="\n")


def _rows(path: Path, labelled: bool) -> Iterator[tuple[int, list[str]]]:
    """(line number, fields padded on the right) of each line; stripped trailing empty fields come back."""
    width = FIELDS_LABELLED if labelled else FIELDS_LABELLED - 1
    minimum = width - len(SPARSE_NAMES)
    with _open_text(path) as text:
        for number, line in enumerate(text, start=1):
            fields = line.rstrip("\r\n").split("\t")
            if not minimum <= len(fields) <= width:
                raise ValueError(f"{path}:{number}: {len(fields)} fields; expected {minimum} to {width}")
            yield number, fields + [""] * (width - len(fields))


def _columns(path: Path, rows: list[tuple[int, list[str]]], labelled: bool) -> list[list]:
    columns: list[list] = [[] for _ in rows[0][1]]
    first_dense = 1 if labelled else 0
    for number, fields in rows:
        try:
            if labelled:
                if fields[0] not in ("0", "1"):
                    raise ValueError(f"label {fields[0]!r} is not 0 or 1")
                columns[0].append(int(fields[0]))
            for j in range(first_dense, first_dense + NUM_DENSE):
                columns[j].append(int(fields[j]) if fields[j] else None)
        except ValueError as error:
            raise ValueError(f"{path}:{number}: {error}") from None
        for j in range(first_dense + NUM_DENSE, len(fields)):
            columns[j].append(fields[j] or None)
    return columns


def convert_file(path: Path, output: Path, labelled: bool, row_group_rows: int) -> int:
    """One TSV file -> one Parquet file, written under a partial name and renamed when whole; returns its rows."""
    schema = arrow_schema(labelled)
    partial = output.with_name(output.name + ".partial")
    rows: list[tuple[int, list[str]]] = []
    total = 0
    try:
        with pq.ParquetWriter(partial, schema) as writer:
            for row in _rows(path, labelled):
                rows.append(row)
                if len(rows) == row_group_rows:
                    writer.write_table(pa.table(_columns(path, rows, labelled), schema=schema), row_group_size=row_group_rows)
                    total, rows = total + len(rows), []
            if rows:
                writer.write_table(pa.table(_columns(path, rows, labelled), schema=schema), row_group_size=row_group_rows)
                total += len(rows)
        if total == 0:
            raise ValueError(f"{path}: no rows")
        partial.replace(output)
    finally:
        partial.unlink(missing_ok=True)
    return total


def to_parquet(input: str | list[str], output: str, labelled: bool = True, row_group_rows: int = 65536) -> None:
    """Raw Criteo TSV -> Parquet files with named columns (label, I1..I13, C1..C26) and string ids,
    one file per input file, each written whole under a temporary name first. See docs/own-data.md.

    Args:
        input: raw TSV files (plain or gzip): a file, a glob, a folder (of *.tsv/*.txt/*.gz) or a list of those.
        output: folder for the Parquet files (created): input ``NAME.tsv`` becomes ``NAME.parquet``.
        labelled: whether the rows start with the label (40 fields); false for Kaggle's test.txt (39).
        row_group_rows: rows per Parquet row group (the unit a reader streams).
    """
    if row_group_rows < 1:
        raise ValueError(f"--row_group_rows {row_group_rows}: must be at least 1")
    folder = Path(output).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    for path in expand_paths(input):
        target = folder / (path.name.split(".")[0] + ".parquet")
        rows = convert_file(path, target, labelled, row_group_rows)
        print(f"{path} -> {target}: {rows:,} rows")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m app.data.to_parquet``; returns the exit status (2 for a bad input)."""
    from app.command import run_command  # noqa: PLC0415 (the converter's functions do not need the command line)

    return run_command(to_parquet, "python -m app.data.to_parquet", argv)


if __name__ == "__main__":
    raise SystemExit(main())
