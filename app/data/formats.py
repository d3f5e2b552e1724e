"""Opening a split in whichever Criteo format its files are: raw TSV (plain or gzip), TorchRec's
NumPy day files, or MLPerf's multi-hot day files."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from app.data.multi_hot import MultiHotDaysSource
from app.data.numpy_days import NumpyDaysSource
from app.data.source import RowSource
from app.data.tsv import CriteoArrays, expand_paths, read_tsv_files
from app.data.tsv import DenseTransform, OnBadRows

DataFormat = Literal["auto", "tsv", "numpy", "multi_hot"]


@dataclass(frozen=True)
class ReadOptions:
    """How rows are turned into model inputs, the same for every split."""

    table_sizes: list[int]
    on_bad_rows: OnBadRows = "error"
    dense_transform: DenseTransform = "log1p"


def detect_format(path: Path) -> str:
    """``multi_hot`` or ``numpy`` for a directory of preprocessed day files, ``tsv`` otherwise."""
    if path.is_dir():
        names = [p.name for p in path.iterdir()]
        if any(MultiHotDaysSource.day_file.fullmatch(n) for n in names):
            return "multi_hot"
        if any(NumpyDaysSource.day_file.fullmatch(n) for n in names):
            return "numpy"
    return "tsv"


def open_split(
    spec: str | Sequence[str],
    data_format: DataFormat,
    options: ReadOptions,
    setting: str,
    days: Sequence[int] | None = None,
    labelled: bool | None = True,
) -> RowSource:
    """The rows named by ``spec`` (a path, glob, directory or list; ``setting`` names it in errors).

    Preprocessed formats take one directory and optionally which of its days to use. Raw TSV must
    carry labels unless ``labelled`` is None (``predict`` also reads unlabelled 39-field files).
    """
    first = Path(spec if isinstance(spec, str) else spec[0]).expanduser()
    resolved = detect_format(first) if data_format == "auto" else data_format
    if resolved == "tsv":
        return read_tsv_split(spec, options, setting, labelled)
    if not isinstance(spec, str):
        raise ValueError(f"{setting}: the {resolved} format takes one directory, got a list {list(spec)}")
    source_class = NumpyDaysSource if resolved == "numpy" else MultiHotDaysSource
    return source_class.from_directory(first, days, options.table_sizes)


def read_tsv_split(
    spec: str | Sequence[str], options: ReadOptions, setting: str, labelled: bool | None = True
) -> CriteoArrays:
    """Parses raw TSV files into memory."""
    try:
        paths = expand_paths(spec)
    except FileNotFoundError as error:
        raise FileNotFoundError(f"{setting}: {error}") from None
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
