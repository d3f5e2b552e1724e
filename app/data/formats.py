"""The Criteo formats a split's files may be in, and opening them: raw TSV (plain or gzip, parsed
into memory), TorchRec's NumPy day files or MLPerf's multi-hot day files (both memory-mapped)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from app.data.multi_hot import MultiHotDaysSource
from app.data.numpy_days import NumpyDaysSource
from app.data.parquet.files import is_parquet_input
from app.data.source import RowSource
from app.data.tsv import CriteoArrays, DenseTransform, OnBadRows, read_tsv_files

DataFormat = Literal["auto", "tsv", "numpy", "multi_hot", "parquet"]


@dataclass(frozen=True)
class ReadOptions:
    """How rows are turned into model inputs, the same for every split."""

    table_sizes: list[int]
    on_bad_rows: OnBadRows = "error"
    dense_transform: DenseTransform = "log1p"


def detect_format(path: Path) -> str:
    """``multi_hot`` or ``numpy`` for a directory of preprocessed day files, ``parquet`` for ``.parquet``
    files (or a folder of them), ``tsv`` otherwise."""
    if is_parquet_input(path):
        return "parquet"
    if path.is_dir():
        names = [p.name for p in path.iterdir()]
        if any(MultiHotDaysSource.day_file.fullmatch(n) for n in names):
            return "multi_hot"
        if any(NumpyDaysSource.day_file.fullmatch(n) for n in names):
            return "numpy"
    return "tsv"


def open_days(folder: Path, data_format: str, days: Sequence[int] | None, options: ReadOptions) -> RowSource:
    """The given days (None: all) of a folder of NumPy or multi-hot day files, memory-mapped."""
    source_class = MultiHotDaysSource if data_format == "multi_hot" else NumpyDaysSource
    return source_class.from_directory(folder, days, options.table_sizes)


def read_tsv_split(paths: Sequence[Path], options: ReadOptions, labelled: bool | None = True) -> CriteoArrays:
    """Raw TSV files parsed into memory (for ``predict``: training splits go through the cache).
    ``labelled=None`` also reads unlabelled 39-field files."""
    return read_tsv_files(
        paths,
        options.table_sizes,
        labelled=labelled,
        on_bad_rows=options.on_bad_rows,
        dense_transform=options.dense_transform,
    )


def rows_view(source: RowSource, start: int, stop: int) -> RowSource:
    """Rows ``[start, stop)`` of a source, without copying them."""
    if isinstance(source, CriteoArrays):
        return CriteoArrays(source.dense[start:stop], source.sparse[start:stop], source.labels[start:stop])
    return source.view(start, stop)  # type: ignore[attr-defined]
