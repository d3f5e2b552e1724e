"""Reading raw Criteo TSV click logs (Kaggle ``train.txt``/``test.txt``, Terabyte days), plain or
gzip-compressed: the public entry points, and the one place where streamed blocks become rows.

The reader has three modules, one job each, read top to bottom:

* :mod:`app.data.tsv_stream`: a file -> blocks of whole lines (gzip decompressed on the fly), so
  the input is never held in memory as a whole;
* :mod:`app.data.tsv_decode`: a block of lines -> arrays (:class:`CriteoArrays`), by vectorised
  numpy with no per-row Python loop, every field checked; what a row is (docs/data.md);
* this module: the entry points (:func:`read_tsv`, :func:`read_tsv_files`,
  :func:`iter_tsv_chunks`, :func:`parse_tsv_bytes`), which decode several blocks at once on a
  thread pool (numpy releases the GIL in its array operations) and place them in file order,
  optionally straight into arrays sized once (:class:`_Output`). The result and the error raised
  are those of the one-thread reader.

Nothing is misparsed silently. By default (``on_bad_rows="error"``) the first malformed line raises
:class:`CriteoFormatError` whose message starts with ``"<file>:<line>: "`` (1-based), naming the
field and value at fault. With ``on_bad_rows="skip"`` malformed lines are dropped instead, counted
in :attr:`CriteoArrays.num_bad_rows`, and the first one's message kept as an example.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from app.data.paths import DATA_SUFFIXES, expand_paths
from app.data.source import check_table_sizes
from app.data.tsv_decode import (
    DENSE_TRANSFORMS,
    LABELLED_FIELDS,
    MIN_LABELLED_FIELDS,
    MIN_UNLABELLED_FIELDS,
    ON_BAD_ROWS,
    UNLABELLED_FIELDS,
    CriteoArrays,
    CriteoFormatError,
    DenseTransform,
    OnBadRows,
)
from app.data.tsv_decode import parse_block as _parse  # looked up per block: tests slow one down
from app.data.tsv_stream import MAX_LINE_BYTES, line_blocks

__all__ = [
    "CHUNK_BYTES",
    "DATA_SUFFIXES",
    "DENSE_TRANSFORMS",
    "LABELLED_FIELDS",
    "MAX_DEFAULT_THREADS",
    "MAX_LINE_BYTES",
    "MIN_LABELLED_FIELDS",
    "MIN_UNLABELLED_FIELDS",
    "ON_BAD_ROWS",
    "UNLABELLED_FIELDS",
    "CriteoArrays",
    "CriteoFormatError",
    "DenseTransform",
    "OnBadRows",
    "default_num_threads",
    "expand_paths",
    "iter_tsv_chunks",
    "parse_tsv_bytes",
    "read_tsv",
    "read_tsv_files",
]

# Files are read and parsed in blocks of whole lines of about this size. The temporary arrays of
# a block are several times its size; keeping them in the CPU caches is measurably faster (16 MiB
# blocks were ~1.5x slower), while much smaller blocks pay numpy's per-call overhead too often.
# The same size is best when blocks are parsed on several threads (measured from 128 KiB to
# 4 MiB on 2 cores): smaller blocks make the threads hand the GIL (held between numpy calls) back
# and forth too often, larger ones spill out of the caches and, from about 2 MiB, make malloc
# return and re-fault the temporaries' pages (tens of thousands of page faults per file).
CHUNK_BYTES = 512 * 1024

# Parse threads by default: one per available core, at most this many (beyond that the reader
# and the memory bandwidth, not the parsing, set the pace).
MAX_DEFAULT_THREADS = 8

# ----------------------------------------------------------------------------------------------
# Public entry points
# ----------------------------------------------------------------------------------------------


def read_tsv(
    path: str | os.PathLike,
    num_embeddings_per_feature: Sequence[int],
    labelled: bool | None = None,
    *,
    on_bad_rows: OnBadRows = "error",
    dense_transform: DenseTransform = "log1p",
    num_threads: int | None = None,
) -> CriteoArrays:
    """Read one raw Criteo TSV file, plain or gzip (by a ``.gz`` name or the gzip magic bytes).

    ``labelled=None`` auto-detects from the field count: 40 fields -> labelled, 39 -> unlabelled.
    Because trailing empty fields may be stripped, the widest row of the first block decides
    (a labelled file whose first row lost its empty C26 still has 40-field rows further down).

    The file is streamed in blocks of whole lines and each block parsed straight into the result,
    so peak memory is about the result plus a few blocks per thread (see :class:`_Output`); use
    :func:`iter_tsv_chunks` to process files larger than memory.

    ``on_bad_rows``: ``"error"`` (default) raises :class:`CriteoFormatError` at the first malformed
    line (wrong field count, a dense value that is not an integer, an id that is not hex, a label
    other than 0/1, control or non-ASCII bytes, an empty line); ``"skip"`` drops such lines, counts
    them in ``num_bad_rows`` and keeps the first one's message in ``first_bad_row``. A truncated
    or corrupt gzip stream raises in both modes: how much is lost is unknown.

    ``dense_transform``: how an integer feature x becomes a float (a missing value is x = 0):
    ``"log1p"`` (default) is ``log(max(x, 0) + 1)``, as facebookresearch/dlrm does;
    ``"log_plus_3"`` is ``log(x + 3)``, TorchRec's NumPy preprocessing before mid-2025 (x is
    clamped to >= -2 to stay finite: Kaggle's I2 is documented to reach -3, where TorchRec's
    formula gives -inf; here -3 gives log(1) = 0, like -2). Both are computed in float64 and
    rounded once to float32 (TorchRec computed in float32: its values may differ in the last bit).

    ``num_threads``: blocks are parsed concurrently on this many threads (numpy releases the GIL in
    its array operations), while this thread reads (and decompresses) the file and places the rows
    in file order. None (default) means one per available core, at most
    :data:`MAX_DEFAULT_THREADS`; 1 parses every block on the calling thread. The result, the
    bad-row counts and the error raised (the one for the first malformed line of the file) do not
    depend on it.
    """
    return read_tsv_files(
        [path], num_embeddings_per_feature, labelled,
        on_bad_rows=on_bad_rows, dense_transform=dense_transform, num_threads=num_threads,
    )


def iter_tsv_chunks(
    path: str | os.PathLike,
    num_embeddings_per_feature: Sequence[int],
    labelled: bool | None = None,
    *,
    block_bytes: int | None = None,
    on_bad_rows: OnBadRows = "error",
    dense_transform: DenseTransform = "log1p",
    num_threads: int | None = 1,
) -> Iterator[tuple[CriteoArrays, int]]:
    """Stream one file (plain or gzip) as parsed blocks of whole lines: ``(rows, num_bad_rows)``.

    For preprocessing files larger than memory. Each block holds about ``block_bytes`` (default
    :data:`CHUNK_BYTES`) of text; the rows are returned in file order, line numbers in errors count
    from the start of the file, and ``labelled=None`` is decided by the first block (as
    :func:`read_tsv` does). ``num_bad_rows`` is the number of lines dropped from this block (only
    with ``on_bad_rows="skip"``; then a block may also hold no rows at all).
    ``on_bad_rows`` ("error" or "skip") and ``dense_transform`` ("log1p" or "log_plus_3") are as
    for :func:`read_tsv`.

    ``num_threads`` is as for :func:`read_tsv`, except that the default is 1: the usual caller
    (``app.data.preprocess``) already runs one process per file. With more, up to ``2 * num_threads``
    blocks are read and parsed ahead of the one handed out.
    """
    path = Path(path)
    moduli = _check_arguments(num_embeddings_per_feature, on_bad_rows, dense_transform)
    threads = _check_threads(num_threads)
    block_bytes = CHUNK_BYTES if block_bytes is None else int(block_bytes)
    if block_bytes < 1:
        raise ValueError(f"block_bytes must be positive, got {block_bytes}")
    for part in _parsed_blocks(path, block_bytes, moduli, labelled, on_bad_rows, dense_transform, threads):
        yield part, part.num_bad_rows


def read_tsv_files(
    paths: Sequence[str | os.PathLike],
    num_embeddings_per_feature: Sequence[int],
    labelled: bool | None = None,
    *,
    on_bad_rows: OnBadRows = "error",
    dense_transform: DenseTransform = "log1p",
    num_threads: int | None = None,
) -> CriteoArrays:
    """Read several files (plain or gzip) and concatenate their rows in the given order.

    With ``labelled=None`` each file is auto-detected, and mixing labelled with unlabelled
    files is an error (their labels could not be used together). ``num_bad_rows`` is the total
    over the files and ``first_bad_row`` the first file's example.
    ``on_bad_rows`` ("error" or "skip"), ``dense_transform`` ("log1p" or "log_plus_3") and
    ``num_threads`` are as for :func:`read_tsv`.
    """
    paths = [Path(paths)] if isinstance(paths, (str, os.PathLike)) else [Path(p) for p in paths]
    moduli = _check_arguments(num_embeddings_per_feature, on_bad_rows, dense_transform)
    threads = _check_threads(num_threads)
    out = _Output([p.stat().st_size for p in paths])
    first_kind: tuple[Path, bool] | None = None
    for path in paths:
        first_row = out.num_rows
        blocks = _parsed_blocks(path, CHUNK_BYTES, moduli, labelled, on_bad_rows, dense_transform, threads, out)
        for _ in blocks:
            pass  # the rows go straight into `out`
        out.files_done += 1
        is_labelled = bool(out.num_rows == first_row or out.arrays.labels[first_row] != -1)
        if first_kind is None:
            first_kind = (path, is_labelled)
        elif is_labelled != first_kind[1]:
            kind = {True: "labelled", False: "unlabelled"}
            raise CriteoFormatError(
                f"{path}:1: file is {kind[is_labelled]} but {first_kind[0]} is "
                f"{kind[first_kind[1]]}; labelled and unlabelled files cannot be mixed"
            )
    return out.result()


def parse_tsv_bytes(
    buf: bytes | bytearray | memoryview,
    first_line_number: int,
    source: str,
    num_embeddings_per_feature: Sequence[int],
    labelled: bool | None,
    *,
    on_bad_rows: OnBadRows = "error",
    dense_transform: DenseTransform = "log1p",
) -> CriteoArrays:
    """Parse whole lines of raw Criteo TSV (the final newline may be missing).

    ``first_line_number`` is the 1-based line number of the first line in ``buf`` and ``source``
    the file name; both only serve error messages, so a streaming reader can call this per block.
    ``on_bad_rows`` ("error" or "skip") and ``dense_transform`` ("log1p" or "log_plus_3") are as
    for :func:`read_tsv`.
    """
    moduli = _check_arguments(num_embeddings_per_feature, on_bad_rows, dense_transform)
    return _parse(buf, first_line_number, source, moduli, labelled, on_bad_rows, dense_transform)[0]


def _check_arguments(
    num_embeddings_per_feature: Sequence[int], on_bad_rows: str, dense_transform: str
) -> np.ndarray:
    """Validate the options; return the table sizes as an int64 array."""
    if on_bad_rows not in ON_BAD_ROWS:
        raise ValueError(f"on_bad_rows must be one of {ON_BAD_ROWS}, got {on_bad_rows!r}")
    if dense_transform not in DENSE_TRANSFORMS:
        raise ValueError(f"dense_transform must be one of {DENSE_TRANSFORMS}, got {dense_transform!r}")
    return check_table_sizes(num_embeddings_per_feature)


def default_num_threads() -> int:
    """Parse threads when ``num_threads`` is None: the cores this process may run on, at most
    :data:`MAX_DEFAULT_THREADS`."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_DEFAULT_THREADS))


def _check_threads(num_threads: int | None) -> int:
    if num_threads is None:
        return default_num_threads()
    if isinstance(num_threads, bool) or not isinstance(num_threads, (int, np.integer)) or num_threads < 1:
        raise ValueError(f"num_threads must be a positive integer or None, got {num_threads!r}")
    return int(num_threads)


# ----------------------------------------------------------------------------------------------
# Blocks decoded on a thread pool, handed out in file order
# ----------------------------------------------------------------------------------------------

# Parses started and not yet handed out, in file order: (the parse, its first row in out.arrays).
_InFlight = deque[tuple[Future, int]]


def _parsed_blocks(
    path: Path,
    block_bytes: int,
    moduli: np.ndarray,
    labelled: bool | None,
    on_bad_rows: str,
    dense_transform: str,
    num_threads: int,
    out: _Output | None = None,
) -> Iterator[CriteoArrays]:
    """Parse one file's blocks and yield them in file order (``labelled=None``: detect per file).

    With ``out``, the rows are parsed straight into it and accounted there; the parts yielded are
    views of them. With ``num_threads`` > 1, this thread reads the blocks and a thread pool parses
    up to ``2 * num_threads`` of them at a time, once the first block(s) have settled whether
    the file is labelled (those are parsed here, as every block is with one thread). Results are
    taken in file order, so what comes out, and the first error raised, are those of the
    sequential reader: a malformed line raises only once every earlier block has been parsed
    without error, and a damaged gzip stream only once the blocks before the damage are done.

    Placement in ``out``: a block's rows are written from ``out.num_rows`` plus the lines of the
    earlier blocks still in flight, which is exact unless rows are dropped (``on_bad_rows="skip"``);
    then its rows are moved up to close the gap once the earlier blocks are done. ``out`` grows (a copy into
    new arrays) only with nothing in flight.
    """
    source = str(path)
    max_in_flight = 2 * num_threads if num_threads > 1 else 0
    in_flight: _InFlight = deque()
    pool: ThreadPoolExecutor | None = None  # once labelled is settled (threads start on demand)
    blocks = line_blocks(path, block_bytes)
    try:
        next_row = 0
        while True:
            try:
                block = next(blocks, None)
            except CriteoFormatError:  # damaged gzip, overlong line: earlier bad lines come first
                yield from _finish_all(in_flight, out)
                raise
            if block is None:
                break
            target = None
            if out is not None:
                if not in_flight:
                    next_row = out.num_rows
                if next_row + block.num_lines > len(out.arrays.labels):
                    # growing replaces the arrays that blocks in flight write to
                    yield from _finish_all(in_flight, out)
                    next_row = out.num_rows
                    out.reserve(block.num_lines, block.fraction_read)
                target = out.arrays
            args = (block.data, block.first_line, source, moduli, labelled, on_bad_rows, dense_transform)
            future = _start_parse(pool, args, target, next_row)
            if pool is None:  # one thread, or still deciding labelled/unlabelled: parsed here
                labelled = future.result()[1]
                if labelled is not None and max_in_flight:
                    pool = ThreadPoolExecutor(num_threads, thread_name_prefix="tsv-parse")
            in_flight.append((future, next_row))
            next_row += block.num_lines
            while len(in_flight) > (max_in_flight if pool is not None else 0):
                yield _finish_oldest(in_flight, out)
        yield from _finish_all(in_flight, out)
    finally:
        if pool is not None:  # on an error: let running parses end (they write into `out`)
            pool.shutdown(wait=True, cancel_futures=True)
        blocks.close()


def _start_parse(
    pool: ThreadPoolExecutor | None, args: tuple, target: CriteoArrays | None, next_row: int
) -> Future:
    """Parse a block on the pool, or, without one, here and now (a finished future)."""
    if pool is None:
        future: Future = Future()
        future.set_result(_parse(*args, target, next_row))
        return future
    return pool.submit(_parse, *args, target, next_row)


def _finish_oldest(in_flight: _InFlight, out: _Output | None) -> CriteoArrays:
    """Wait for the oldest parse in flight and account its rows in ``out``."""
    future, row = in_flight.popleft()
    part = future.result()[0]  # a malformed line raises here, after all earlier blocks
    if out is not None:
        if row != out.num_rows:  # earlier blocks dropped bad rows: close the gap
            rows = slice(out.num_rows, out.num_rows + len(part))
            for whole, done in zip(out.arrays.columns(), part.columns()):
                whole[rows] = done  # numpy copies safely between overlapping views
        out.append(part)
    return part


def _finish_all(in_flight: _InFlight, out: _Output | None) -> Iterator[CriteoArrays]:
    """Every parse in flight, oldest first."""
    while in_flight:
        yield _finish_oldest(in_flight, out)


# ----------------------------------------------------------------------------------------------
# Where read_tsv_files puts its rows
# ----------------------------------------------------------------------------------------------

class _Output:
    """Rows parsed in place into arrays sized from an estimate of the final row count.

    Concatenating parsed blocks would briefly hold the result twice. Instead the row count is
    extrapolated from how far into the files the reader is (on disk, so compressed bytes for
    gzip) and the arrays allocated once, generously: pages of a large ``np.empty`` that are never
    written cost no memory (the OS maps them on first write), so the slack is free. If the
    estimate still falls short, the arrays grow by a copy (re-estimated, so rarely twice).
    """

    SLACK = 1.25  # rows per byte vary along a file (missing values); gzip positions run ahead

    def __init__(self, file_sizes: Sequence[int]) -> None:
        self.file_sizes = list(file_sizes)  # on disk; 0 for a pipe, whose size is unknown
        self.files_done = 0
        self.arrays = CriteoArrays.empty(0)
        self.num_rows = 0
        self.num_bad_rows = 0
        self.first_bad_row: str | None = None

    def reserve(self, num_rows: int, fraction_of_file: float) -> None:
        """Make room for ``num_rows`` more rows, ``fraction_of_file`` (0..1] of the current file
        (the ``files_done``-th) having been read."""
        needed = self.num_rows + num_rows
        capacity = len(self.arrays)
        if needed <= capacity:
            return
        done = sum(self.file_sizes[: self.files_done])
        done += fraction_of_file * self.file_sizes[self.files_done]
        fraction = done / sum(self.file_sizes) if done else 1.0
        estimate = int(needed / fraction * self.SLACK)
        grown = CriteoArrays.empty(max(needed, estimate, capacity + capacity // 4))
        for new, old in zip(grown.columns(), self.arrays.columns()):
            new[: self.num_rows] = old[: self.num_rows]
        self.arrays = grown

    def append(self, part: CriteoArrays) -> None:
        """Account for rows just parsed into ``arrays[num_rows:]``."""
        self.num_rows += len(part)
        self.num_bad_rows += part.num_bad_rows
        self.first_bad_row = self.first_bad_row or part.first_bad_row

    def result(self) -> CriteoArrays:
        """Views of the rows (the unused, never-written tail stays unmapped)."""
        rows = slice(0, self.num_rows)
        dense, sparse, labels = (column[rows] for column in self.arrays.columns())
        return CriteoArrays(dense, sparse, labels, self.num_bad_rows, self.first_bad_row)
