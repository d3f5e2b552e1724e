"""MLPerf DLRMv2 multi-hot Criteo (docs/data.md): reading and writing.

Day ``N`` is ``day_N_dense.npy`` and ``day_N_labels.npy`` (as in TorchRec's NumPy layout) plus
``day_N_sparse_multi_hot.npz``: keys "0".."25", int32 ``(rows, m_j)``, a bag of ``m_j`` ids per row
for feature ``j``.

Reading: ``np.load`` of an .npz reads a member whole, so :class:`MultiHotDaysSource` maps the
members itself: an .npz is a zip archive whose members, when written by ``np.savez``, are stored
uncompressed, i.e. plain .npy files lying at known offsets inside the archive. Compressed members
(``np.savez_compressed``) cannot be mapped and are refused with a clear error.

Writing: :func:`write_multi_hot_days` follows MLPerf's construction (facebookresearch/dlrm :
torchrec_dlrm/multi_hot.py): with ``np.random.seed(seed)``, per table ``j`` in order a lookup
``T_j`` of shape ``(E_j, m_j)`` whose column 0 is the original id and whose other columns are
random ids in ``[0, E_j)``; a row's bag for feature ``j`` is ``T_j[id % E_j]``. The random draws
are the same as the reference's, so with MLPerf's table sizes and multi-hot sizes this reproduces
MLPerf's multi-hot dataset. Run it as a converter::

    python -m app.data.multi_hot --input PREPROCESSED_DIR --output DIR [--days "[0, 1]"]
"""

from __future__ import annotations

import json
import os
import re
import struct
import warnings
import zipfile
from typing import Literal
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np

from app.criteo import NUM_DENSE, NUM_SPARSE
from app.data.numpy_days import (
    DENSE_DTYPES,
    LABEL_DTYPES,
    SPARSE_DTYPES,
    MappedDays,
    check_array,
    check_same_rows,
    ids_as_int64,
    open_npy,
    reduce_ids,
    require_day_files,
)
from app.data.source import RowBlock, check_table_sizes

# MLPerf DLRMv2 (docs/data.md).
MLPERF_TABLE_SIZES = (
    40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10, 2209,
    11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36,
)
MLPERF_MULTI_HOT_SIZES = (3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1)

MULTI_HOT_KEYS = tuple(str(j) for j in range(NUM_SPARSE))
_DAY_FILE = re.compile(r"day_(\d+)_sparse_multi_hot\.npz")
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., file name length, extra field length
_LOCAL_HEADER_SIGNATURE = b"PK\x03\x04"
# Rows of a lookup table drawn, or of a day mapped, per step: bounds the temporary memory.
TABLE_ROWS_PER_STEP = 1 << 20
DAY_ROWS_PER_STEP = 1 << 18


class MultiHotDaysSource(MappedDays):
    """Rows of MLPerf multi-hot day files, memory-mapped; ``take`` gives 26 bags per row.

    Args:
        prefixes: one path prefix per day, in row order: ``/data/day_3`` stands for
            ``day_3_dense.npy``, ``day_3_labels.npy`` and ``day_3_sparse_multi_hot.npz`` there.
        num_embeddings_per_feature: the 26 table sizes; each id is taken modulo its table's size.
        start_row: first row of the range, counted in the concatenated days.
        stop_row: end of the range (exclusive); None = the end of the last day.
        multi_hot_sizes: the expected bag size of each feature (None = whatever the first day has;
            every day must have the same).

    Raises FileNotFoundError naming a missing file and ValueError naming the file (and key) for a
    missing key, a compressed member, a wrong dtype or shape, or row counts that differ. Labels are
    not checked to be in {-1, 0, 1}: that would read every labels file whole.
    """

    day_file = _DAY_FILE
    day_glob = "day_*_sparse_multi_hot.npz"

    def __init__(
        self,
        prefixes: Sequence[str | os.PathLike],
        num_embeddings_per_feature: Sequence[int],
        start_row: int = 0,
        stop_row: int | None = None,
        multi_hot_sizes: Sequence[int] | None = None,
    ) -> None:
        self.multi_hot_sizes = None if multi_hot_sizes is None else tuple(int(m) for m in multi_hot_sizes)
        if self.multi_hot_sizes is not None and len(self.multi_hot_sizes) != NUM_SPARSE:
            raise ValueError(f"multi_hot_sizes must be {NUM_SPARSE} bag sizes, got {list(multi_hot_sizes)!r}")
        self._dense: list[np.ndarray] = []
        self._labels: list[np.ndarray] = []
        self._bags: list[list[np.ndarray]] = []  # per day, 26 arrays (rows, m_j)
        super().__init__(prefixes, num_embeddings_per_feature, start_row, stop_row)
        self._init_args["multi_hot_sizes"] = multi_hot_sizes

    def _open(self, prefix: Path) -> int:
        dense_path, labels_path, npz_path = multi_hot_day_paths(prefix)
        require_day_files(f"multi-hot day {prefix.name}", (dense_path, labels_path, npz_path))
        dense = open_npy(dense_path, DENSE_DTYPES, width=NUM_DENSE)
        labels = open_npy(labels_path, LABEL_DTYPES, width=None)
        members = map_npz(npz_path, MULTI_HOT_KEYS)
        bags = [members[key] for key in MULTI_HOT_KEYS]
        for key, bag in zip(MULTI_HOT_KEYS, bags):
            self._check_bag(npz_path, key, bag)
        check_same_rows(
            [(dense_path, dense), (labels_path, labels)]
            + [(f"{npz_path}[{key!r}]", bag) for key, bag in zip(MULTI_HOT_KEYS, bags)]
        )
        if self.multi_hot_sizes is None:  # the first day sets the bag sizes that the others must have
            self.multi_hot_sizes = tuple(int(bag.shape[1]) for bag in bags)
        self._dense.append(dense)
        self._labels.append(labels.reshape(-1))
        self._bags.append(bags)
        return int(dense.shape[0])

    def _check_bag(self, npz_path: Path, key: str, bag: np.ndarray) -> None:
        where = f"{npz_path}[{key!r}]"
        expected = None if self.multi_hot_sizes is None else self.multi_hot_sizes[int(key)]
        if bag.ndim != 2 or bag.shape[1] < 1 or (expected is not None and bag.shape[1] != expected):
            width = "m_j >= 1" if expected is None else f"{expected}"
            raise ValueError(f"{where}: shape {bag.shape}, expected (rows, {width}) (the bags of feature {key})")
        check_array(where, bag, SPARSE_DTYPES, width=bag.shape[1])

    def take(self, rows: np.ndarray) -> RowBlock:
        """The rows at the given positions (in this source's range), in that order."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        plan = self._plan(rows)
        assert self.multi_hot_sizes is not None
        dense = np.empty((rows.size, NUM_DENSE), dtype=np.float32)
        labels = np.empty((rows.size,), dtype=np.float32)
        sparse = [np.empty((rows.size, m), dtype=np.int64) for m in self.multi_hot_sizes]
        for day, out, src in plan:
            dense[out] = self._dense[day][src]
            labels[out] = self._labels[day][src]
            for j, bag in enumerate(self._bags[day]):
                sparse[j][out] = reduce_ids(bag[src], self.moduli[j])
        return RowBlock(dense, sparse, labels)


def multi_hot_day_paths(prefix: str | os.PathLike) -> tuple[Path, Path, Path]:
    """The dense, labels and multi-hot sparse files of the day with this path prefix."""
    prefix = os.fspath(prefix)
    return Path(f"{prefix}_dense.npy"), Path(f"{prefix}_labels.npy"), Path(f"{prefix}_sparse_multi_hot.npz")


# ----------------------------------------------------------------------------------------------
# Memory-mapping the members of an .npz
# ----------------------------------------------------------------------------------------------


def map_npz(path: Path, keys: Sequence[str]) -> dict[str, np.ndarray]:
    """Read-only arrays over the given members of an uncompressed .npz, without reading their data.

    One mapping of the whole file serves every member (one file descriptor per file, however many
    members); each array is a view at its member's data offset.
    """
    offsets = _member_data_offsets(path, keys)
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    arrays = {}
    with open(path, "rb") as file:
        for key, (data_start, member_bytes) in offsets.items():
            arrays[key] = _array_at(path, key, file, mapped, data_start, member_bytes)
    return arrays


def _member_data_offsets(path: Path, keys: Sequence[str]) -> dict[str, tuple[int, int]]:
    """Per key: where its .npy member starts in the file, and its size; errors name the file."""
    try:
        with zipfile.ZipFile(path) as archive:
            infos = {info.filename: info for info in archive.infolist()}
    except (zipfile.BadZipFile, OSError) as error:
        raise ValueError(f"{path}: not a readable .npz (zip) file ({error})") from None
    present = sorted(name.removesuffix(".npy") for name in infos)
    offsets = {}
    with open(path, "rb") as file:
        for key in keys:
            info = infos.get(f"{key}.npy")
            if info is None:
                raise ValueError(f"{path}: no array {key!r}; expected keys '0'..'{NUM_SPARSE - 1}', found {present}")
            if info.compress_type != zipfile.ZIP_STORED:
                raise ValueError(
                    f"{path}: member {key!r} is compressed (zip method {info.compress_type}), so it cannot "
                    "be memory-mapped; re-save the arrays with np.savez (not np.savez_compressed)"
                )
            # The data follows the member's *local* header, whose extra field may differ in length
            # from the central directory's copy: read the lengths from the local header itself.
            file.seek(info.header_offset)
            signature, name_length, extra_length = _LOCAL_HEADER.unpack(file.read(_LOCAL_HEADER.size))
            if signature != _LOCAL_HEADER_SIGNATURE:
                raise ValueError(f"{path}: member {key!r} has a corrupt zip header")
            data_start = info.header_offset + _LOCAL_HEADER.size + name_length + extra_length
            offsets[key] = (data_start, info.file_size)
    return offsets


def _array_at(path: Path, key: str, file, mapped: np.memmap, data_start: int, member_bytes: int) -> np.ndarray:
    """The array of the .npy member starting at ``data_start``, as a view of ``mapped``."""
    where = f"{path}[{key!r}]"
    file.seek(data_start)
    try:
        version = np.lib.format.read_magic(file)
        # Format 3.0 only differs from 2.0 by allowing utf-8 in the header; the reader is the same.
        reader = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran_order, dtype = reader(file)
    except ValueError as error:
        raise ValueError(f"{where}: not a .npy member ({error})") from None
    header_bytes = file.tell() - data_start
    data_bytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if dtype.hasobject:
        raise ValueError(f"{where}: dtype {dtype} holds Python objects, expected int32 or int64")
    if header_bytes + data_bytes > member_bytes:
        raise ValueError(f"{where}: truncated: its header promises {data_bytes} bytes of data, the member holds fewer")
    return np.ndarray(
        shape, dtype=dtype, buffer=mapped, offset=data_start + header_bytes, order="F" if fortran_order else "C"
    )


# ----------------------------------------------------------------------------------------------
# Writing multi-hot days (MLPerf's construction)
# ----------------------------------------------------------------------------------------------


def multi_hot_tables(
    table_sizes: Sequence[int], multi_hot_sizes: Sequence[int], seed: int = 0, distribution: str = "uniform"
) -> Iterator[np.ndarray]:
    """MLPerf's lookup tables ``T_j`` (int32 ``(E_j, m_j)``), one at a time, table 0 first.

    The draws are those of the reference: ``np.random.seed(seed)``, then per table
    ``randint(0, E_j, size=(E_j, m_j - 1))`` (or ``pareto(0.25, ...)`` cast to int32, modulo E_j).
    They are made in row blocks, which consumes the same random stream as one call (each value
    takes its own draws), so only one table is in memory at a time.
    """
    if distribution not in ("uniform", "pareto"):
        raise ValueError(f"distribution = {distribution!r}: expected 'uniform' or 'pareto'")
    rng = np.random.RandomState(seed)  # the legacy generator: the stream np.random.seed gives
    for size, bag in zip(table_sizes, multi_hot_sizes):
        table = np.empty((size, bag), dtype=np.int32)
        table[:, 0] = np.arange(size, dtype=np.int32)
        for lo in range(0, size, TABLE_ROWS_PER_STEP) if bag > 1 else ():
            hi = min(lo + TABLE_ROWS_PER_STEP, size)
            if distribution == "uniform":
                table[lo:hi, 1:] = rng.randint(0, size, size=(hi - lo, bag - 1))
            else:
                with warnings.catch_warnings():  # huge draws overflow int32, as in the reference
                    warnings.simplefilter("ignore", RuntimeWarning)
                    draws = rng.pareto(a=0.25, size=(hi - lo, bag - 1)).astype(np.int32)
                table[lo:hi, 1:] = draws.astype(np.int64) % size
        yield table


def write_multi_hot_day(
    out_dir: str | os.PathLike,
    day: int,
    dense: np.ndarray,
    sparse_one_hot: np.ndarray,
    labels: np.ndarray,
    table_sizes: Sequence[int] = MLPERF_TABLE_SIZES,
    multi_hot_sizes: Sequence[int] = MLPERF_MULTI_HOT_SIZES,
    seed: int = 0,
    distribution: str = "uniform",
) -> Path:
    """Write one multi-hot day (``day_N_dense.npy``, ``day_N_labels.npy``,
    ``day_N_sparse_multi_hot.npz``) from one-hot arrays; returns the day's path prefix."""
    days = {day: (dense, sparse_one_hot, labels)}
    return write_multi_hot_days(out_dir, days, table_sizes, multi_hot_sizes, seed, distribution)[0]


def write_multi_hot_days(
    out_dir: str | os.PathLike,
    days: Mapping[int, tuple[np.ndarray, np.ndarray, np.ndarray]],
    table_sizes: Sequence[int] = MLPERF_TABLE_SIZES,
    multi_hot_sizes: Sequence[int] = MLPERF_MULTI_HOT_SIZES,
    seed: int = 0,
    distribution: str = "uniform",
) -> list[Path]:
    """Write several multi-hot days, drawing each lookup table once for all of them.

    ``days`` maps a day number to ``(dense float32 (rows, 13), sparse ids int32/int64 (rows, 26),
    labels (rows,) or (rows, 1))``; the arrays may be memory-mapped (they are read in row blocks).
    Memory: the largest table ``E_j x m_j`` int32 plus one block of rows. Files appear under their
    final names only when complete.
    """
    sizes = check_table_sizes(table_sizes)
    if sizes.max() > 2**31:  # the bags are int32, as in MLPerf's files
        raise ValueError(f"table sizes must be at most 2**31 for int32 multi-hot ids, got {sizes.max()}")
    if len(multi_hot_sizes) != NUM_SPARSE or min(multi_hot_sizes) < 1:
        raise ValueError(f"multi_hot_sizes must be {NUM_SPARSE} bag sizes >= 1, got {list(multi_hot_sizes)!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for number, arrays in days.items():
        dense, sparse, _ = arrays
        check_array(f"day {number} dense", dense, DENSE_DTYPES, NUM_DENSE)
        check_array(f"day {number} sparse", sparse, SPARSE_DTYPES, NUM_SPARSE)
        check_same_rows([(f"day {number} {name}", array) for name, array in zip(("dense", "sparse", "labels"), arrays)])
    archives = {n: _open_npz_for_writing(out / f"day_{n}_sparse_multi_hot.npz") for n in days}
    try:
        for j, table in enumerate(multi_hot_tables(sizes.tolist(), multi_hot_sizes, seed, distribution)):
            for number, (_, sparse, _) in days.items():
                _write_bags(archives[number], str(j), table, sparse, j)
    except BaseException:
        for archive in archives.values():
            archive.close()
            Path(archive.filename).unlink(missing_ok=True)
        raise
    prefixes = []
    for number, (dense, _, labels) in days.items():
        prefix = out / f"day_{number}"
        _save_npy(Path(f"{prefix}_dense.npy"), np.asarray(dense, dtype=np.float32))
        _save_npy(Path(f"{prefix}_labels.npy"), np.asarray(labels).reshape(-1, 1).astype(np.int32, copy=False))
        archives[number].close()
        os.replace(archives[number].filename, f"{prefix}_sparse_multi_hot.npz")
        prefixes.append(prefix)
    return prefixes


def _open_npz_for_writing(final_path: Path) -> zipfile.ZipFile:
    # What np.savez does: stored (uncompressed) members, zip64 allowed for members over 4 GiB.
    return zipfile.ZipFile(f"{final_path}.partial", mode="w", compression=zipfile.ZIP_STORED, allowZip64=True)


def _write_bags(archive: zipfile.ZipFile, key: str, table: np.ndarray, sparse: np.ndarray, j: int) -> None:
    """Member ``key``: ``table[ids % E_j]`` for the ids of column ``j``, written block by block."""
    rows, size = sparse.shape[0], table.shape[0]
    descr = np.lib.format.dtype_to_descr(np.dtype(np.int32))
    header = {"descr": descr, "fortran_order": False, "shape": (rows, table.shape[1])}
    with archive.open(f"{key}.npy", mode="w", force_zip64=True) as member:
        np.lib.format.write_array_header_1_0(member, header)
        for lo in range(0, rows, DAY_ROWS_PER_STEP):
            ids = ids_as_int64(np.asarray(sparse[lo : lo + DAY_ROWS_PER_STEP, j])) % size
            member.write(np.ascontiguousarray(table[ids]).tobytes())


def _save_npy(path: Path, array: np.ndarray) -> None:
    """np.save under a temporary name, then rename: a file under its final name is complete."""
    partial = Path(f"{path}.partial")
    with open(partial, "wb") as file:
        np.lib.format.write_array(file, array, allow_pickle=False)
    os.replace(partial, path)


# ----------------------------------------------------------------------------------------------
# Command line: NumPy days -> multi-hot days
# ----------------------------------------------------------------------------------------------


def convert(
    input: str,
    output: str,
    days: list[int] | None = None,
    num_embeddings_per_feature: list[int] = list(MLPERF_TABLE_SIZES),
    multi_hot_sizes: list[int] = list(MLPERF_MULTI_HOT_SIZES),
    seed: int = 0,
    distribution: Literal["uniform", "pareto"] = "uniform",
) -> None:
    """Convert TorchRec NumPy days (day_N_{dense,sparse,labels}.npy, e.g. from app.data.preprocess) into
    MLPerf DLRMv2 multi-hot days (day_N_sparse_multi_hot.npz plus copies of dense and labels).
    Memory: the largest lookup table (E_j x m_j int32; about 16 GB for MLPerf's 40M x 100) plus a
    block of rows.

    Args:
        input: folder of day_N_{dense,sparse,labels}.npy files.
        output: folder to write the multi-hot days to (created if needed).
        days: day numbers to convert (default: all found).
        num_embeddings_per_feature: the 26 table sizes E_j (default: MLPerf's).
        multi_hot_sizes: the 26 bag sizes m_j (default: MLPerf's, 214 ids per row).
        seed: seed of the lookup tables (MLPerf: 0).
        distribution: distribution of the extra ids (MLPerf: uniform).
    """
    from app.data.numpy_days import NumpyDaysSource  # noqa: PLC0415 (only the converter needs it)

    source = NumpyDaysSource.from_directory(input, days, [1] * NUM_SPARSE)  # moduli unused here
    numbers = [int(p.name.removeprefix("day_")) for p in source.prefixes]
    arrays = {n: source.day_arrays(i) for i, n in enumerate(numbers)}
    written = write_multi_hot_days(output, arrays, num_embeddings_per_feature, multi_hot_sizes, seed, distribution)
    print(json.dumps({"written": [str(p) for p in written]}))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m app.data.multi_hot``; returns the exit status (2 for a bad input)."""
    from app.command import run_command  # noqa: PLC0415 (the reader does not need the command line)

    return run_command(convert, "python -m app.data.multi_hot", argv)


if __name__ == "__main__":
    raise SystemExit(main())
