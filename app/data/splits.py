"""Which files hold each split's rows: the splits a stage reads, from ``data.train``/``val``/``test``/
``predict`` or from a standard split by name (docs/data.md).

* ``kaggle``: Kaggle's ``train.txt`` cut into 7 equal "days" (facebookresearch/dlrm data_utils):
  days 0-5 train; day 6 split in half, the first half test and the second half validation.
* ``terabyte``: days 0-22 train; day 23 split in half, the first half validation and the second
  half test (TorchRec, MLPerf).

Only the splits of the stage are looked at: ``fit`` needs ``train`` (and ``val`` if given),
``validate`` ``val``, ``test`` ``test`` and ``predict`` ``predict``; nothing else is opened.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from app.data.formats import DataFormat, detect_format
from app.data.parquet.files import parquet_files
from app.data.paths import expand_paths

SplitName = Literal["kaggle", "terabyte"]
KAGGLE_DAYS = 7
TERABYTE_TRAIN_DAYS = tuple(range(23))
TERABYTE_EVAL_DAY = 23
SPLITS_BY_STAGE = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",), "predict": ("predict",)}

# Which rows of the files a split is: all, or a part of a standard split.
RowPart = Literal["all", "kaggle_train", "kaggle_test", "kaggle_val", "first_half", "second_half"]


@dataclass(frozen=True)
class SplitFiles:
    """Where one split's rows are.

    setting: the setting that named them (``data.train``, ``data.root``), for error messages.
    files: raw TSV files in order (``format == "tsv"``), or one folder of day files.
    format: ``tsv``, ``numpy`` or ``multi_hot`` (resolved, never ``auto``).
    days: which days of a folder (None: all).
    part: which rows of them (see :func:`part_rows`).
    """

    setting: str
    files: tuple[Path, ...]
    format: str
    days: tuple[int, ...] | None = None
    part: RowPart = "all"


def day_bounds(num_rows: int, num_days: int) -> list[tuple[int, int]]:
    """Row ranges of ``num_days`` equal days; the first ``num_rows % num_days`` get one row more."""
    per_day, extra = divmod(num_rows, num_days)
    bounds, start = [], 0
    for day in range(num_days):
        stop = start + per_day + int(day < extra)
        bounds.append((start, stop))
        start = stop
    return bounds


def halves(start: int, stop: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The first and second half of ``[start, stop)``; the first gets the odd row (numpy.array_split)."""
    middle = start + (stop - start + 1) // 2
    return (start, middle), (middle, stop)


def part_rows(part: RowPart, num_rows: int) -> tuple[int, int]:
    """The row range ``[start, stop)`` that ``part`` is of ``num_rows`` rows."""
    if part == "all":
        return 0, num_rows
    if part.startswith("kaggle"):
        days = day_bounds(num_rows, KAGGLE_DAYS)
        test, val = halves(*days[-1])
        return {"kaggle_train": (0, days[-2][1]), "kaggle_test": test, "kaggle_val": val}[part]
    first, second = halves(0, num_rows)
    return first if part == "first_half" else second


def split_files(
    specs: dict[str, str | list[str]],
    split: SplitName | None,
    root: str | None,
    data_format: DataFormat,
    wanted: Sequence[str],
) -> dict[str, SplitFiles]:
    """The files of each ``wanted`` split that is set; FileNotFoundError naming the setting for
    files that do not exist, ValueError for a needed split that is not set."""
    found = {}
    optional = ("val",) if "train" in wanted else ()  # fitting without validation is allowed
    for name in wanted:
        if split is not None and name != "predict":
            assert root is not None
            found[name] = _named_split_files(split, root, data_format, name)
        elif name in specs:
            found[name] = _given_files(f"data.{name}", specs[name], data_format)
        elif name not in optional:
            raise ValueError(f"data.{name} is not set, and this stage reads it")
    return found


def _given_files(setting: str, spec: str | list[str], data_format: DataFormat) -> SplitFiles:
    first = Path(spec if isinstance(spec, str) else spec[0]).expanduser()
    resolved = detect_format(first) if data_format == "auto" else data_format
    try:
        if resolved == "tsv":
            return SplitFiles(setting, tuple(expand_paths(spec)), "tsv")
        if resolved == "parquet":
            return SplitFiles(setting, tuple(parquet_files(spec)), "parquet")
        if not isinstance(spec, str):
            raise ValueError(f"{setting}: the {resolved} format takes one directory, got a list {list(spec)}")
        if not first.is_dir():
            raise FileNotFoundError(f"{first}: data directory does not exist")
    except FileNotFoundError as error:
        raise FileNotFoundError(f"{setting}: {error}") from None
    return SplitFiles(setting, (first,), resolved)


def _named_split_files(name: SplitName, root: str, data_format: DataFormat, split: str) -> SplitFiles:
    if name == "kaggle":
        # One file (or one preprocessed day) holding all of train.txt, cut by row ranges.
        return _with_part(_given_files("data.root", root, data_format), f"kaggle_{split}")
    if name != "terabyte":
        raise ValueError(f"data.split = {name!r} is not one of kaggle, terabyte")
    folder = Path(root).expanduser()
    days = TERABYTE_TRAIN_DAYS if split == "train" else (TERABYTE_EVAL_DAY,)
    part = {"train": "all", "val": "first_half", "test": "second_half"}[split]
    resolved = detect_format(folder) if data_format == "auto" else data_format
    if resolved == "tsv":
        return SplitFiles("data.root", tuple(_raw_days(folder, days)), "tsv", None, part)
    return SplitFiles("data.root", (folder,), resolved, days, part)


def _with_part(files: SplitFiles, part: str) -> SplitFiles:
    return SplitFiles(files.setting, files.files, files.format, files.days, part)  # type: ignore[arg-type]


def _raw_days(folder: Path, days: Sequence[int]) -> list[Path]:
    """Raw day files ``day_N`` or ``day_N.gz`` of a folder, in day order."""
    paths = []
    for day in days:
        candidates = [folder / f"day_{day}", folder / f"day_{day}.gz"]
        found = next((p for p in candidates if p.is_file()), None)
        if found is None:
            raise FileNotFoundError(f"data.root: {candidates[0]} (or .gz) does not exist; the terabyte split needs days 0-23")
        paths.append(found)
    return paths
