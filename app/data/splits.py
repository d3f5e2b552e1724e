"""The standard Criteo splits, by name (see ../shared/docs/criteo-formats.md).

* ``kaggle``: Kaggle's ``train.txt`` cut into 7 equal "days" (facebookresearch/dlrm data_utils):
  days 0-5 train; day 6 split in half, the first half test and the second half validation.
* ``terabyte``: days 0-22 train; day 23 split in half, the first half validation and the second
  half test (TorchRec, MLPerf).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from app.data.formats import DataFormat, ReadOptions, detect_format, open_split, rows_view
from app.data.source import RowSource

SplitName = Literal["kaggle", "terabyte"]
KAGGLE_DAYS = 7
TERABYTE_TRAIN_DAYS = tuple(range(23))
TERABYTE_EVAL_DAY = 23


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


def named_split(name: SplitName, root: str, data_format: DataFormat, options: ReadOptions) -> dict[str, RowSource]:
    """``{"train", "val", "test"}`` sources of a standard split of the data at ``root``."""
    if name == "kaggle":
        return _kaggle(root, data_format, options)
    if name == "terabyte":
        return _terabyte(root, data_format, options)
    raise ValueError(f"data.split = {name!r} is not one of kaggle, terabyte")


def _kaggle(root: str, data_format: DataFormat, options: ReadOptions) -> dict[str, RowSource]:
    # One file (or one preprocessed day) holding all of train.txt, cut by row ranges.
    everything = open_split(root, data_format, options, "data.root")
    days = day_bounds(len(everything), KAGGLE_DAYS)
    test, val = halves(*days[-1])
    return {
        "train": rows_view(everything, 0, days[-2][1]),
        "test": rows_view(everything, *test),
        "val": rows_view(everything, *val),
    }


def _terabyte(root: str, data_format: DataFormat, options: ReadOptions) -> dict[str, RowSource]:
    folder = Path(root).expanduser()
    resolved = detect_format(folder) if data_format == "auto" else data_format
    if resolved == "tsv":
        train = open_split(_raw_days(folder, TERABYTE_TRAIN_DAYS), "tsv", options, "data.root")
        day_23 = open_split(_raw_days(folder, [TERABYTE_EVAL_DAY]), "tsv", options, "data.root")
    else:
        train = open_split(str(folder), resolved, options, "data.root", days=TERABYTE_TRAIN_DAYS)
        day_23 = open_split(str(folder), resolved, options, "data.root", days=[TERABYTE_EVAL_DAY])
    val, test = halves(0, len(day_23))
    return {"train": train, "val": rows_view(day_23, *val), "test": rows_view(day_23, *test)}


def _raw_days(folder: Path, days: Sequence[int]) -> list[str]:
    """Raw day files ``day_N`` or ``day_N.gz`` of a folder, in day order."""
    paths = []
    for day in days:
        candidates = [folder / f"day_{day}", folder / f"day_{day}.gz"]
        found = next((p for p in candidates if p.is_file()), None)
        if found is None:
            raise FileNotFoundError(f"data.root: {candidates[0]} (or .gz) does not exist; the terabyte split needs days 0-23")
        paths.append(str(found))
    return paths
