"""TorchRec's preprocessed NumPy layout (docs/data.md), memory-mapped.

A dataset is a folder of days; day ``N`` is three files:

===================== ================================ =======================================
file                  dtype / shape                    content
===================== ================================ =======================================
``day_N_dense.npy``   float32 (rows, 13)               integer features, already transformed
``day_N_sparse.npy``  int32 or int64 (rows, 26)        hashed or contiguous categorical ids
``day_N_labels.npy``  int32 (rows, 1) or (rows,)       0/1; -1 for unlabelled rows
===================== ================================ =======================================

Files are opened with ``np.load(..., mmap_mode="r")``: only the rows a batch needs are read, so a
split may be far larger than RAM. Days are concatenated in the order given, and a source may be a
row range of them (``start_row``/``stop_row``), e.g. "first half of day 23" for validation.

Sparse ids: TorchRec stores raw 32-bit hashes as int64; an int32 file holding raw hashes shows the
ids above 2**31 as negative numbers, so int32 ids are read as their unsigned 32-bit value (which
leaves contiguous ids, always below 2**31, unchanged). Every id is then taken modulo its table
size, as TorchRec's loader does, giving non-negative int64 ids.

``app.data.preprocess`` writes this layout from raw TSV; ``app.data.multi_hot`` reads MLPerf's multi-hot
variant with the same machinery (``MappedDays``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from app.criteo import NUM_DENSE, NUM_SPARSE
from app.data.source import RowBlock, check_table_sizes

# Above this many separate runs of consecutive rows, one fancy-indexed gather per day beats a slice
# read per run (each slice costs a few microseconds of Python per array).
MAX_SLICE_RUNS = 64

DENSE_DTYPES = (np.dtype(np.float32),)
SPARSE_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))
LABEL_DTYPES = (np.dtype(np.int32),)

_DAY_FILE = re.compile(r"day_(\d+)_dense\.npy")


class MappedDays:
    """Row addressing shared by the memory-mapped day sources: days, a row range, pickling.

    Subclasses open their files in ``_open(prefix)`` (returning the day's row count) and gather
    rows with ``_plan``. Only the constructor arguments are pickled: DataLoader workers reopen the
    files instead of receiving copies of the mapped data (pickling a memmap copies all of it).
    """

    def __init__(
        self,
        prefixes: Sequence[str | os.PathLike],
        num_embeddings_per_feature: Sequence[int],
        start_row: int = 0,
        stop_row: int | None = None,
    ) -> None:
        self._init_args = dict(
            prefixes=[Path(p) for p in prefixes],
            num_embeddings_per_feature=list(num_embeddings_per_feature),
            start_row=start_row,
            stop_row=stop_row,
        )
        self.prefixes = self._init_args["prefixes"]
        if not self.prefixes:
            raise ValueError("no days given: a memory-mapped source needs at least one day")
        self.moduli = check_table_sizes(num_embeddings_per_feature)
        rows_per_day = np.array([self._open(prefix) for prefix in self.prefixes], dtype=np.int64)
        self.rows_per_day = rows_per_day
        # day_starts[d] is the first concatenated row of day d; day_starts[-1] the total.
        self.day_starts = np.concatenate(([0], np.cumsum(rows_per_day)))
        total_rows = int(self.day_starts[-1])
        stop_row = total_rows if stop_row is None else stop_row
        if not 0 <= start_row <= stop_row <= total_rows:
            raise ValueError(
                f"row range [{start_row}, {stop_row}) is not within the {total_rows} rows of "
                f"{self._describe_days()}"
            )
        self.start_row, self.stop_row = int(start_row), int(stop_row)

    # The file that marks a day in a folder, set by each subclass (e.g. day_N_dense.npy).
    day_file: re.Pattern
    day_glob: str

    @classmethod
    def from_directory(
        cls,
        path: str | os.PathLike,
        days: Sequence[int] | None,
        num_embeddings_per_feature: Sequence[int],
        start_row: int = 0,
        stop_row: int | None = None,
        **options: Any,
    ) -> "MappedDays":
        """The given days of a folder (None = every day whose ``day_glob`` file is there, by increasing N)."""
        prefixes = find_days(path, days, cls.day_file, cls.day_glob)
        return cls(prefixes, num_embeddings_per_feature, start_row, stop_row, **options)

    def _open(self, prefix: Path) -> int:
        raise NotImplementedError

    def __len__(self) -> int:
        return self.stop_row - self.start_row

    @property
    def in_memory(self) -> bool:
        """False: reads are page faults on the mapped files, so batches should be contiguous rows."""
        return False

    @property
    def total_rows(self) -> int:
        """Rows of all the days, ignoring the row range."""
        return int(self.day_starts[-1])

    def view(self, start_row: int, stop_row: int) -> "MappedDays":
        """Rows ``[start_row, stop_row)`` of this source, sharing its open files."""
        if not 0 <= start_row <= stop_row <= len(self):
            raise ValueError(f"row range [{start_row}, {stop_row}) is not within the {len(self)} rows of this source")
        view = object.__new__(type(self))  # not copy.copy: that would pickle, i.e. reopen the files
        view.__dict__.update(self.__dict__)
        view.start_row, view.stop_row = self.start_row + start_row, self.start_row + stop_row
        view._init_args = dict(self._init_args, start_row=view.start_row, stop_row=view.stop_row)
        return view

    def __getstate__(self) -> dict[str, Any]:
        return {"init_args": self._init_args}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state["init_args"])  # reopen the files in this process

    def _describe_days(self) -> str:
        names = [p.name for p in self.prefixes]
        shown = ", ".join(names[:4]) + (f", ... ({len(names)} days)" if len(names) > 4 else "")
        return f"{shown} in {self.prefixes[0].parent}"

    def _plan(self, rows: np.ndarray) -> list[tuple[int, slice | np.ndarray, slice | np.ndarray]]:
        """How to gather ``rows`` (positions in this source): a list of
        ``(day, output positions, rows within the day)``, to be used as ``out[o] = day_array[r]``.

        Consecutive rows within one day become slices (a sequential read of the mapped file); rows
        in many scattered places become one fancy-indexed gather per day.
        """
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        if rows.size and (int(rows.min()) < 0 or int(rows.max()) >= len(self)):
            bad = rows[(rows < 0) | (rows >= len(self))][0]
            raise IndexError(f"row {int(bad)} is out of range for a source of {len(self)} rows")
        if rows.size == 0:
            return []
        global_rows = rows + self.start_row
        day = np.searchsorted(self.day_starts, global_rows, side="right") - 1
        local = global_rows - self.day_starts[day]
        breaks = np.flatnonzero((np.diff(global_rows) != 1) | (np.diff(day) != 0)) + 1
        if breaks.size < MAX_SLICE_RUNS:
            run_starts = np.concatenate(([0], breaks)).tolist()
            run_stops = np.concatenate((breaks, [rows.size])).tolist()
            return [
                (int(day[a]), slice(a, b), slice(int(local[a]), int(local[a]) + b - a))
                for a, b in zip(run_starts, run_stops)
            ]
        plan = []
        for d in np.unique(day).tolist():
            positions = np.flatnonzero(day == d)
            plan.append((d, positions, local[positions]))
        return plan


class NumpyDaysSource(MappedDays):
    """Rows of TorchRec NumPy day files (``day_N_{dense,sparse,labels}.npy``), memory-mapped.

    Args:
        prefixes: one path prefix per day, in row order: ``/data/day_3`` stands for
            ``/data/day_3_dense.npy``, ``/data/day_3_sparse.npy`` and ``/data/day_3_labels.npy``.
        num_embeddings_per_feature: the 26 table sizes; each id is taken modulo its table's size.
        start_row: first row of the range, counted in the concatenated days.
        stop_row: end of the range (exclusive); None = the end of the last day.

    Raises FileNotFoundError naming a missing file, and ValueError naming the file for a wrong dtype
    or shape, an unreadable file, or files of one day with different row counts. Labels are not
    checked to be in {-1, 0, 1}: that would read every labels file whole before training starts.
    """

    day_file = _DAY_FILE
    day_glob = "day_*_dense.npy"

    def __init__(
        self,
        prefixes: Sequence[str | os.PathLike],
        num_embeddings_per_feature: Sequence[int],
        start_row: int = 0,
        stop_row: int | None = None,
    ) -> None:
        self._dense: list[np.ndarray] = []
        self._sparse: list[np.ndarray] = []
        self._labels: list[np.ndarray] = []  # (rows,)
        super().__init__(prefixes, num_embeddings_per_feature, start_row, stop_row)

    def _open(self, prefix: Path) -> int:
        dense_path, sparse_path, labels_path = day_paths(prefix)
        require_day_files(f"day {prefix.name}", (dense_path, sparse_path, labels_path))
        dense = open_npy(dense_path, DENSE_DTYPES, width=NUM_DENSE)
        sparse = open_npy(sparse_path, SPARSE_DTYPES, width=NUM_SPARSE)
        labels = open_npy(labels_path, LABEL_DTYPES, width=None)
        check_same_rows([(dense_path, dense), (sparse_path, sparse), (labels_path, labels)])
        self._dense.append(dense)
        self._sparse.append(sparse)
        self._labels.append(labels.reshape(-1))
        return int(dense.shape[0])

    def day_arrays(self, day_index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The mapped ``(dense, sparse, labels (rows,))`` of the ``day_index``-th day, as stored
        (ids neither converted nor reduced modulo the table sizes; the row range is ignored)."""
        return self._dense[day_index], self._sparse[day_index], self._labels[day_index]

    def take(self, rows: np.ndarray) -> RowBlock:
        """The rows at the given positions (in this source's range), in that order."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        plan = self._plan(rows)
        dense = np.empty((rows.size, NUM_DENSE), dtype=np.float32)
        sparse = np.empty((rows.size, NUM_SPARSE), dtype=np.int64)
        labels = np.empty((rows.size,), dtype=np.float32)
        for day, out, src in plan:
            dense[out] = self._dense[day][src]
            sparse[out] = reduce_ids(self._sparse[day][src], self.moduli)
            labels[out] = self._labels[day][src]
        return RowBlock(dense, sparse, labels)


# ----------------------------------------------------------------------------------------------
# Helpers shared with the multi-hot source and the preprocessor
# ----------------------------------------------------------------------------------------------


def day_paths(prefix: str | os.PathLike) -> tuple[Path, Path, Path]:
    """The dense, sparse and labels files of the day with this path prefix."""
    prefix = os.fspath(prefix)
    return Path(f"{prefix}_dense.npy"), Path(f"{prefix}_sparse.npy"), Path(f"{prefix}_labels.npy")


def require_day_files(day: str, paths: Sequence[Path]) -> None:
    """A FileNotFoundError naming the first missing file of a day and all the files the day needs."""
    for path in paths:
        if not path.is_file():
            needed = ", ".join(p.name for p in paths[:-1]) + f" and {paths[-1].name}"
            raise FileNotFoundError(f"{path}: missing; {day} needs {needed}")


def find_days(
    path: str | os.PathLike, days: Sequence[int] | None, pattern: re.Pattern, glob_text: str
) -> list[Path]:
    """Day prefixes (``DIR/day_N``) of a folder: the given days, or every day whose name matches."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: data directory does not exist")
    found = {int(m.group(1)) for p in folder.iterdir() if (m := pattern.fullmatch(p.name))}
    if not found:
        raise FileNotFoundError(f"{folder}: no {glob_text} files (not a preprocessed Criteo directory)")
    if days is None:
        days = sorted(found)
    missing = [d for d in days if d not in found]
    if missing:
        example = glob_text.replace("*", str(missing[0]))
        raise FileNotFoundError(
            f"{folder / example}: missing (day {missing[0]} was asked for; days present: {sorted(found)})"
        )
    return [folder / f"day_{d}" for d in days]


def open_npy(path: Path, dtypes: Sequence[np.dtype], width: int | None) -> np.ndarray:
    """Memory-map a 2-D ``(rows, width)`` .npy file; ``width=None`` means labels, (rows,) or (rows, 1)."""
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as error:
        raise ValueError(f"{path}: not a readable .npy file ({error})") from None
    check_array(path, array, dtypes, width)
    return array


def check_array(where: Path | str, array: np.ndarray, dtypes: Sequence[np.dtype], width: int | None) -> None:
    """ValueError naming ``where`` when the array's dtype or shape is not the expected one."""
    if array.dtype not in dtypes:
        expected = " or ".join(str(d) for d in dtypes)
        raise ValueError(f"{where}: dtype {array.dtype}, expected {expected}")
    if width is None:
        ok, expected = array.ndim == 1 or (array.ndim == 2 and array.shape[1] == 1), "(rows,) or (rows, 1)"
    else:
        ok, expected = array.ndim == 2 and array.shape[1] == width, f"(rows, {width})"
    if not ok:
        raise ValueError(f"{where}: shape {array.shape}, expected {expected}")


def check_same_rows(arrays: Sequence[tuple[Path | str, np.ndarray]]) -> None:
    """ValueError naming two files of one day whose row counts differ."""
    first_where, first = arrays[0]
    for where, array in arrays[1:]:
        if array.shape[0] != first.shape[0]:
            raise ValueError(
                f"row counts differ within one day: {first_where} has {first.shape[0]} rows "
                f"but {where} has {array.shape[0]}"
            )


def reduce_ids(ids: np.ndarray, moduli: np.ndarray | int) -> np.ndarray:
    """Stored ids (int32 or int64) modulo the table sizes (broadcast against ``ids``), as
    non-negative ids (see :func:`ids_as_int64` for what int32 ids mean)."""
    moduli = np.asarray(moduli, dtype=np.int64)
    if ids.dtype == np.int32 and moduli.max(initial=0) < 2**32:
        # The same values, computed in 32 bits: about 4x faster than int64 division.
        return np.remainder(ids.view(np.uint32), moduli.astype(np.uint32))
    return np.remainder(ids_as_int64(ids), moduli)


def ids_as_int64(ids: np.ndarray) -> np.ndarray:
    """Ids as non-negative int64 where they were stored as int32: the unsigned 32-bit value.

    A raw 32-bit hash stored as int32 reads as a negative number from 2**31 on; its unsigned value
    is the id that an int64 file (or the raw TSV) holds. int64 ids are returned unchanged (a
    negative one then maps into the table by the floor modulo that follows).
    """
    if ids.dtype == np.int32:
        return ids.view(np.uint32).astype(np.int64)
    return ids.astype(np.int64, copy=False)
