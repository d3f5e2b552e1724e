"""Fast, strict, streaming reader for raw Criteo TSV click logs (Kaggle ``train.txt``/``test.txt``,
Terabyte days), plain or gzip-compressed.

Format (see docs/criteo-formats.md, section 1): one sample per line, tab-separated
``label, I1..I13, C1..C26`` (40 fields), or ``I1..I13, C1..C26`` (39 fields) for unlabelled files.
An empty field is a missing value. Files in the wild strip trailing empty fields, so a short row is
padded with empty fields *on the right* (never aligned from the right-hand end).

Nothing is misparsed silently. By default (``on_bad_rows="error"``) the first malformed line raises
:class:`CriteoFormatError` whose message starts with ``"<file>:<line>: "`` (1-based), naming the
field and value at fault. With ``on_bad_rows="skip"`` malformed lines are dropped instead, counted
in :attr:`CriteoArrays.num_bad_rows`, and the first one's message kept as an example.

A file is read as a stream of blocks of whole lines of about :data:`CHUNK_BYTES` (a ``.gz`` file,
or any file starting with the gzip magic bytes, is decompressed on the fly), so the input is never
held in memory as a whole. Each block is parsed by vectorised numpy; there is no per-row Python
loop. :func:`read_tsv` parses several blocks at once on a thread pool (numpy releases the GIL in
its array operations) and places them in file order: the result and the error raised are those of
the one-thread reader. Field values are decoded eight bytes at a time: an unaligned ``uint64`` view of the block
lets one fancy-index gather fetch the (up to) eight bytes ending at every field's end, and SWAR
("SIMD within a register") bit arithmetic validates and converts them.
"""

from __future__ import annotations

import contextlib
import glob
import gzip
import os
import re
import zlib
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Literal

import numpy as np

from app.data.source import RowBlock

NUM_DENSE = 13
NUM_SPARSE = 26
LABELLED_FIELDS = 1 + NUM_DENSE + NUM_SPARSE  # 40
UNLABELLED_FIELDS = NUM_DENSE + NUM_SPARSE  # 39

DENSE_NAMES = tuple(f"I{i}" for i in range(1, NUM_DENSE + 1))
SPARSE_NAMES = tuple(f"C{i}" for i in range(1, NUM_SPARSE + 1))

OnBadRows = Literal["error", "skip"]
DenseTransform = Literal["log1p", "log_plus_3"]
ON_BAD_ROWS: tuple[str, ...] = ("error", "skip")
DENSE_TRANSFORMS: tuple[str, ...] = ("log1p", "log_plus_3")

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

# A valid row is under 600 bytes (13 dense values of at most 19 characters, 26 ids of at most 8).
# A "line" this long without a newline means the file is not Criteo text; refusing it keeps the
# memory of the block reader bounded.
MAX_LINE_BYTES = 1024 * 1024

# File name endings a data directory is searched for.
DATA_SUFFIXES = (".tsv", ".txt", ".gz")  # .gz covers .tsv.gz and .txt.gz

_GZIP_MAGIC = b"\x1f\x8b"
# What a damaged gzip stream raises: truncation (EOFError), bad header/CRC/length (BadGzipFile),
# corrupt deflate data (zlib.error).
_GZIP_ERRORS = (EOFError, gzip.BadGzipFile, zlib.error)

# Longest accepted dense value: 18 digits always fit in int64 (19 may not).
_MAX_DENSE_DIGITS = 18
_MAX_HEX_DIGITS = 8
# Zero bytes in front of the data, so that the 8-byte windows ending at any field end (up to
# three of them for an 18-digit value) never start before the array.
_PAD_FRONT = 24

_TAB, _LF, _CR, _MINUS = 9, 10, 13, 45

# SWAR constants: one value per byte lane of a uint64.
_LSB = np.uint64(0x0101010101010101)
_HIGH = np.uint64(0x8080808080808080)
_LOW_NIBBLES = np.uint64(0x0F0F0F0F0F0F0F0F)
_LANES16 = np.uint64(0x00FF00FF00FF00FF)  # the low byte of every 16-bit lane
_LANES32 = np.uint64(0x0000FFFF0000FFFF)  # the low half of every 32-bit lane
# _KEEP_TOP[n] keeps the top n bytes of a little-endian word: the last n bytes before its end.
_KEEP_TOP = np.array(
    [(0xFFFFFFFFFFFFFFFF << (8 * (8 - n))) & 0xFFFFFFFFFFFFFFFF for n in range(9)], dtype=np.uint64
)


class CriteoFormatError(ValueError):
    """A malformed Criteo TSV input. The message starts with ``"<file>:<line>: "`` (1-based)."""


@dataclass
class CriteoArrays:
    """Parsed rows, ready for a model.

    dense: float32 (N, 13), the transformed integer features (``dense_transform``): by default
        ``log(max(x, 0) + 1)``; missing -> raw value 0 before the transform.
    sparse: int64 (N, 26), the 32-bit hex id modulo ``num_embeddings_per_feature[j]``; missing -> 0.
    labels: float32 (N,), 0/1; -1 for rows of an unlabelled (39-field) file.
    num_bad_rows: malformed lines dropped by ``on_bad_rows="skip"`` (always 0 with "error").
    first_bad_row: the error message (``"<file>:<line>: ..."``) of the first dropped line, if any.
    """

    dense: np.ndarray
    sparse: np.ndarray
    labels: np.ndarray
    num_bad_rows: int = 0
    first_bad_row: str | None = None

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @property
    def in_memory(self) -> bool:
        return True

    def take(self, rows: np.ndarray) -> RowBlock:
        """The rows at the given positions (the RowSource interface)."""
        return RowBlock(self.dense[rows], self.sparse[rows], self.labels[rows])

    @staticmethod
    def concat(parts: Sequence["CriteoArrays"]) -> "CriteoArrays":
        """Concatenate row-wise, in the given order (an empty sequence gives zero rows).

        The bad-row counts add up; the first part's ``first_bad_row`` example is kept.
        """
        if len(parts) == 1:
            return parts[0]
        if not parts:
            return _empty_arrays(0)
        return CriteoArrays(
            dense=np.concatenate([p.dense for p in parts]),
            sparse=np.concatenate([p.sparse for p in parts]),
            labels=np.concatenate([p.labels for p in parts]),
            num_bad_rows=sum(p.num_bad_rows for p in parts),
            first_bad_row=next((p.first_bad_row for p in parts if p.first_bad_row), None),
        )


def _empty_arrays(num_rows: int) -> CriteoArrays:
    """Uninitialised arrays for ``num_rows`` rows."""
    return CriteoArrays(
        dense=np.empty((num_rows, NUM_DENSE), np.float32),
        sparse=np.empty((num_rows, NUM_SPARSE), np.int64),
        labels=np.empty((num_rows,), np.float32),
    )


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
    (``app.preprocess``) already runs one process per file. With more, up to ``2 * num_threads``
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
    return _check_moduli(num_embeddings_per_feature)


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


def _check_moduli(num_embeddings_per_feature: Sequence[int]) -> np.ndarray:
    moduli = np.asarray(num_embeddings_per_feature, dtype=np.int64)
    if moduli.shape != (NUM_SPARSE,) or (moduli <= 0).any():
        raise ValueError(
            f"num_embeddings_per_feature must be {NUM_SPARSE} positive table sizes, "
            f"got {list(num_embeddings_per_feature)!r}"
        )
    return moduli


# ----------------------------------------------------------------------------------------------
# Path specs
# ----------------------------------------------------------------------------------------------


def expand_paths(spec: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    """Resolve a data spec into a list of files.

    ``spec`` is a file, a glob pattern, a directory (its ``*.tsv``, ``*.txt`` and ``*.gz`` files,
    e.g. ``day_0.gz`` or ``train.txt.gz``) or a list of those (expanded in order). The files of a
    directory or a pattern come in natural order, so ``day_2`` precedes ``day_10`` (the Terabyte
    days are in time order). Raises FileNotFoundError naming the spec when something matches
    nothing.
    """
    items = [spec] if isinstance(spec, (str, os.PathLike)) else list(spec)
    if not items:
        raise FileNotFoundError("no data files given: the list of paths is empty")
    files: list[Path] = []
    for item in items:
        files.extend(_expand_one(item))
    return files


def _expand_one(item: str | os.PathLike) -> list[Path]:
    text = os.path.expanduser(os.fspath(item))
    path = Path(text)
    if path.is_dir():
        found = [p for p in path.iterdir() if p.name.endswith(DATA_SUFFIXES) and p.is_file()]
        if not found:
            raise FileNotFoundError(
                f"data directory {text!r} contains no *.tsv or *.txt files (plain or .gz)"
            )
        return sorted(found, key=_natural_key)
    if path.is_file():
        return [path]
    if glob.has_magic(text):
        found = [Path(p) for p in glob.glob(text, recursive=True) if os.path.isfile(p)]
        if not found:
            raise FileNotFoundError(f"no data files match the pattern {text!r}")
        return sorted(found, key=_natural_key)
    raise FileNotFoundError(f"data file or directory {text!r} does not exist")


def _natural_key(path: Path) -> tuple[list[str | int], str]:
    """Sort key comparing digit runs as numbers: ``day_2`` < ``day_10``.

    Splitting on a captured digit group alternates text and digits from the first element on, so
    two keys always compare str with str and int with int. The full text breaks ties (``01``/``1``).
    """
    text = str(path)
    pieces = re.split(r"(\d+)", text)
    return [int(piece) if i % 2 else piece for i, piece in enumerate(pieces)], text


# ----------------------------------------------------------------------------------------------
# Streaming whole-line blocks
# ----------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _open_text_stream(path: Path) -> Iterator[tuple[BinaryIO, BinaryIO]]:
    """(text stream, file on disk). A ``.gz`` name or gzip's magic bytes, whatever the name, mean
    gzip, decompressed incrementally as the stream is read (a ``.gz`` that is not gzip fails
    loudly rather than being parsed as text)."""
    with open(path, "rb") as raw:
        # peek, not read and seek back: a pipe cannot seek.
        if path.name.endswith(".gz") or raw.peek(2)[:2] == _GZIP_MAGIC:
            with gzip.GzipFile(fileobj=raw, mode="rb") as stream:
                yield stream, raw
        else:
            yield raw, raw


@dataclass
class _Block:
    """Whole lines of a file."""

    first_line: int  # 1-based number of the first line
    data: bytes  # the lines, each with its newline (but the file's last line may lack it)
    num_lines: int
    fraction_read: float  # how far into the file on disk (compressed, for gzip) reading has got


def _line_blocks(path: Path, block_bytes: int) -> Iterator[_Block]:
    """The file's lines in blocks of about ``block_bytes``. Memory: a block and a partial line.

    Raises CriteoFormatError for an empty file, a damaged gzip stream or an overlong line.
    """
    source = str(path)
    lines_done = 0  # complete lines handed out so far
    pending: list[bytes] = []  # the start of a line whose newline has not been read yet
    pending_bytes = 0
    with _open_text_stream(path) as (stream, raw):
        size = os.fstat(raw.fileno()).st_size  # 0 for a pipe
        while data := _read_block(stream, block_bytes, source, lines_done):
            cut = data.rfind(b"\n") + 1
            if cut == 0:  # still inside one line (blocks smaller than a line, or no newlines)
                pending.append(data)
                pending_bytes += len(data)
                if pending_bytes > MAX_LINE_BYTES:
                    raise CriteoFormatError(
                        f"{source}:{lines_done + 1}: line is longer than {MAX_LINE_BYTES} bytes "
                        "(a Criteo row is under 600): not Criteo TSV text"
                    )
                continue
            block = b"".join([*pending, memoryview(data)[:cut]])
            num_lines = _count_newlines(block)
            fraction_read = min(raw.tell() / size, 1.0) if size else 1.0
            yield _Block(lines_done + 1, block, num_lines, fraction_read)
            lines_done += num_lines
            pending, pending_bytes = [data[cut:]], len(data) - cut
    if pending_bytes:
        yield _Block(lines_done + 1, b"".join(pending), 1, 1.0)
    elif lines_done == 0:
        raise CriteoFormatError(f"{source}:1: file is empty (no rows)")


def _count_newlines(data: bytes) -> int:
    # numpy's vectorised compare-and-count is about 3x faster than bytes.count here.
    return int(np.count_nonzero(np.frombuffer(data, dtype=np.uint8) == _LF))


def _read_block(stream: BinaryIO, size: int, source: str, lines_done: int) -> bytes:
    """Up to ``size`` bytes; a damaged gzip stream becomes a CriteoFormatError naming the file."""
    try:
        return stream.read(size)
    except _GZIP_ERRORS as exc:
        raise CriteoFormatError(
            f"{source}:{max(lines_done, 1)}: gzip stream is truncated or corrupt after "
            f"{lines_done} complete lines ({exc})"
        ) from exc


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
    in_flight: deque[tuple[Future, int]] = deque()  # (parse, first row in out.arrays), file order
    pool: ThreadPoolExecutor | None = None  # once labelled is settled (threads start on demand)

    def finish_oldest() -> CriteoArrays:
        future, row = in_flight.popleft()
        part = future.result()[0]  # a malformed line raises here, after all earlier blocks
        if out is not None:
            if row != out.num_rows:  # earlier blocks dropped bad rows: close the gap
                rows = slice(out.num_rows, out.num_rows + len(part))
                for whole, done in zip(_columns(out.arrays), _columns(part)):
                    whole[rows] = done  # numpy copies safely between overlapping views
            out.append(part)
        return part

    blocks = _line_blocks(path, block_bytes)
    try:
        next_row = 0
        while True:
            try:
                block = next(blocks, None)
            except CriteoFormatError:  # damaged gzip, overlong line: earlier bad lines come first
                while in_flight:
                    yield finish_oldest()
                raise
            if block is None:
                break
            target = None
            if out is not None:
                if not in_flight:
                    next_row = out.num_rows
                if next_row + block.num_lines > len(out.arrays.labels):
                    while in_flight:  # growing replaces the arrays that blocks in flight write to
                        yield finish_oldest()
                    next_row = out.num_rows
                    out.reserve(block.num_lines, block.fraction_read)
                target = out.arrays
            args = (block.data, block.first_line, source, moduli, labelled, on_bad_rows, dense_transform)
            future: Future = Future()
            if pool is None:  # one thread, or still deciding labelled/unlabelled: parse here
                result = _parse(*args, target, next_row)
                future.set_result(result)
                labelled = result[1]
                if labelled is not None and max_in_flight:
                    pool = ThreadPoolExecutor(num_threads, thread_name_prefix="tsv-parse")
            else:
                future = pool.submit(_parse, *args, target, next_row)
            in_flight.append((future, next_row))
            next_row += block.num_lines
            while len(in_flight) > (max_in_flight if pool is not None else 0):
                yield finish_oldest()
        while in_flight:
            yield finish_oldest()
    finally:
        if pool is not None:  # on an error: let running parses end (they write into `out`)
            pool.shutdown(wait=True, cancel_futures=True)
        blocks.close()


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
        self.arrays = _empty_arrays(0)
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
        grown = _empty_arrays(max(needed, estimate, capacity + capacity // 4))
        for new, old in zip(_columns(grown), _columns(self.arrays)):
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
        dense, sparse, labels = (column[rows] for column in _columns(self.arrays))
        return CriteoArrays(dense, sparse, labels, self.num_bad_rows, self.first_bad_row)


def _columns(arrays: CriteoArrays) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return arrays.dense, arrays.sparse, arrays.labels


# ----------------------------------------------------------------------------------------------
# Parsing core
# ----------------------------------------------------------------------------------------------


@dataclass
class _Lines:
    """Where the lines and fields of a padded buffer are (absolute offsets into ``data``)."""

    data: np.ndarray  # uint8: _PAD_FRONT zero bytes, the input, a '\n' if the input lacked one
    words: np.ndarray  # uint64 view: words[i] holds data[i : i + 8], little-endian
    seps: np.ndarray  # int64: offset of every tab and newline, in order (one per field)
    newline_seps: np.ndarray  # int64: indices into seps of the newlines (one per line)
    field_counts: np.ndarray  # int64 (N,): fields per line
    line_starts: np.ndarray  # int64 (N,)
    line_ends: np.ndarray  # int64 (N,): end of the content, before any '\r\n'
    has_cr: np.ndarray  # bool (N,): the line ends with '\r\n'


@dataclass
class _Context:
    """What error messages need: the file name, line numbering and detection details."""

    source: str
    first_line_number: int
    lines: _Lines
    detection_note: str = ""  # how labelled/unlabelled was decided, for label errors

    def error(self, row: int, what: str) -> CriteoFormatError:
        return CriteoFormatError(f"{self.source}:{self.first_line_number + row}: {what}")

    def field_text(self, start: int, end: int) -> str:
        raw = self.lines.data[start:end].tobytes()
        if len(raw) > 40:
            raw = raw[:37] + b"..."
        return repr(raw.decode("ascii", errors="backslashreplace"))


# Ranks of the kinds of problem on one line: the lowest is reported. Structural problems come
# before field values (whose rank is the field's position), as the line cannot be split reliably.
_RANK_BYTES_OR_EMPTY, _RANK_TOO_MANY = -2, -1


class _BadRows:
    """The malformed lines of a block: a row mask and the first problem (row, rank, message)."""

    def __init__(self) -> None:
        self.mask: np.ndarray | None = None  # bool (N,); None until a problem is found
        self.first: tuple[int, int, str] | None = None

    def add(self, bad: np.ndarray, rank: int, message: Callable[[int, int], str]) -> None:
        """Flag the rows where ``bad`` ((N,) or (N, columns) bool) is set; ``message(row, column)``
        describes a problem and is called for the first one only."""
        if not bad.any():  # the usual case: one fast flat scan
            return
        per_row = bad if bad.ndim == 1 else bad.any(axis=1)
        row = int(np.argmax(per_row))
        column = int(np.argmax(bad[row])) if bad.ndim == 2 else 0
        if self.first is None or (row, rank + column) < self.first[:2]:
            self.first = (row, rank + column, message(row, column))
        self.mask = per_row.copy() if self.mask is None else self.mask | per_row


def _parse(
    buf: bytes | bytearray | memoryview,
    first_line_number: int,
    source: str,
    moduli: np.ndarray,
    labelled: bool | None,
    on_bad_rows: str = "error",
    dense_transform: str = "log1p",
    out: CriteoArrays | None = None,
    out_row: int = 0,
) -> tuple[CriteoArrays, bool | None]:
    """Parse ``buf``; also return whether it was read as labelled (the auto-detection result,
    still None when ``labelled`` was None and every line was dropped as malformed).

    With ``out``, the rows are written to ``out[out_row:]`` and views of them are returned.
    """
    if len(buf) == 0:
        raise CriteoFormatError(f"{source}:{first_line_number}: empty input (no rows)")
    lines = _split_lines(buf)
    num_rows = lines.field_counts.size
    ctx = _Context(source, first_line_number, lines)
    bad_rows = _BadRows()
    _find_structural_problems(lines, bad_rows)
    skip = on_bad_rows == "skip"
    labelled, ctx.detection_note = _detect_labelled(lines, labelled, ctx, bad_rows, skip)
    if labelled is None:  # skipping, and no line was usable: nothing to parse
        return _all_bad(ctx, bad_rows, num_rows), None
    num_fields = LABELLED_FIELDS if labelled else UNLABELLED_FIELDS
    bad_rows.add(
        lines.field_counts > num_fields,
        _RANK_TOO_MANY,
        lambda r, _: _too_many_message(int(lines.field_counts[r]), labelled),
    )
    if out is None:
        out, out_row = _empty_arrays(num_rows), 0
    rows = slice(out_row, out_row + num_rows)
    result = CriteoArrays(out.dense[rows], out.sparse[rows], out.labels[rows])
    _parse_fields(lines, num_fields, moduli, dense_transform, ctx, bad_rows, result)
    if bad_rows.first is None:
        return result, labelled
    row, _, message = bad_rows.first
    if not skip:
        raise ctx.error(row, message)
    return _drop_rows(result, bad_rows.mask, str(ctx.error(row, message))), labelled


def _parse_fields(
    lines: _Lines,
    num_fields: int,
    moduli: np.ndarray,
    dense_transform: str,
    ctx: _Context,
    bad_rows: _BadRows,
    result: CriteoArrays,
) -> None:
    """Decode every line's fields into ``result`` (values of malformed lines are garbage and
    flagged in ``bad_rows``)."""
    starts, ends = _field_bounds(lines, num_fields)  # (N, F): row-major keeps gathers sequential
    first_dense = num_fields - UNLABELLED_FIELDS
    first_sparse = num_fields - NUM_SPARSE
    if first_dense:
        result.labels[:] = _parse_labels(lines, starts[:, 0], ends[:, 0], ctx, bad_rows)
    else:
        result.labels[:] = -1.0
    dense_fields = slice(first_dense, first_sparse)
    result.dense[:] = _parse_dense(
        lines, starts[:, dense_fields], ends[:, dense_fields], first_dense, dense_transform, ctx, bad_rows
    )
    sparse_fields = slice(first_sparse, num_fields)
    result.sparse[:] = _parse_sparse(
        lines, starts[:, sparse_fields], ends[:, sparse_fields], first_sparse, moduli, ctx, bad_rows
    )


def _drop_rows(result: CriteoArrays, bad: np.ndarray, first_bad_row: str) -> CriteoArrays:
    """Move the good rows to the front of ``result`` (in place: it may be a view of the output)
    and return views of them, with the count and example of the dropped ones."""
    keep = ~bad
    num_good = int(np.count_nonzero(keep))
    # The right-hand side is a fancy-indexed copy, so overlapping the destination is safe.
    result.dense[:num_good] = result.dense[keep]
    result.sparse[:num_good] = result.sparse[keep]
    result.labels[:num_good] = result.labels[keep]
    return CriteoArrays(
        result.dense[:num_good],
        result.sparse[:num_good],
        result.labels[:num_good],
        num_bad_rows=int(bad.size - num_good),
        first_bad_row=first_bad_row,
    )


def _all_bad(ctx: _Context, bad_rows: _BadRows, num_rows: int) -> CriteoArrays:
    """No rows: every one of the ``num_rows`` lines was malformed and is dropped."""
    assert bad_rows.first is not None
    row, _, message = bad_rows.first
    empty = _empty_arrays(0)
    empty.num_bad_rows, empty.first_bad_row = num_rows, str(ctx.error(row, message))
    return empty


def _split_lines(buf: bytes | bytearray | memoryview) -> _Lines:
    """Copy ``buf`` into a padded array and locate every separator, line and CR."""
    raw = np.frombuffer(buf, dtype=np.uint8)
    needs_newline = raw[-1] != _LF
    data = np.empty(_PAD_FRONT + raw.size + int(needs_newline), dtype=np.uint8)
    data[:_PAD_FRONT] = 0
    data[_PAD_FRONT : _PAD_FRONT + raw.size] = raw
    if needs_newline:
        data[-1] = _LF
    body = data[_PAD_FRONT:]
    # uint8 wrap-around: (b - 9) < 2 holds exactly for tab (9) and newline (10).
    seps = np.flatnonzero((body - np.uint8(_TAB)) < 2) + _PAD_FRONT
    newline_seps = np.flatnonzero(data[seps] == _LF)
    line_feeds = seps[newline_seps]
    has_cr = data[line_feeds - 1] == _CR
    line_ends = line_feeds - has_cr
    line_starts = np.empty_like(line_feeds)
    line_starts[0] = _PAD_FRONT
    line_starts[1:] = line_feeds[:-1] + 1
    field_counts = np.diff(newline_seps, prepend=-1)
    words = np.ndarray(shape=(data.size - 7,), dtype="<u8", buffer=data, offset=0, strides=(1,))
    return _Lines(data, words, seps, newline_seps, field_counts, line_starts, line_ends, has_cr)


def _find_structural_problems(lines: _Lines, bad_rows: _BadRows) -> None:
    """Flag the lines that are not text, have a stray '\\r', or are empty."""
    body = lines.data[_PAD_FRONT:]
    # uint8 wrap-around: (b - 32) > 94 holds for control bytes, DEL and non-ASCII bytes.
    not_printable = np.count_nonzero((body - np.uint8(32)) > 94)
    if not_printable != lines.seps.size + np.count_nonzero(lines.has_cr):  # rare: find them
        positions = _bad_byte_positions(lines)
        line_feeds = lines.line_ends + lines.has_cr
        bad = np.zeros(line_feeds.size, dtype=bool)
        bad[np.searchsorted(line_feeds, positions)] = True
        bad_rows.add(bad, _RANK_BYTES_OR_EMPTY, lambda r, _: _bad_byte_message(lines, r, positions[0]))
    bad_rows.add(
        lines.line_ends == lines.line_starts,
        _RANK_BYTES_OR_EMPTY,
        lambda r, _: "empty line (blank lines are not allowed)",
    )


def _bad_byte_positions(lines: _Lines) -> np.ndarray:
    """Offsets of the bytes that are not printable ASCII, tab, or the '\\r' of a '\\r\\n'."""
    data = lines.data
    bad = (data - np.uint8(32)) > 94
    bad[:_PAD_FRONT] = False
    bad[lines.seps] = False
    bad[lines.line_ends[lines.has_cr]] = False
    return np.flatnonzero(bad)


def _bad_byte_message(lines: _Lines, row: int, pos: int) -> str:
    """Describe the bad byte at offset ``pos`` of line ``row``."""
    column = pos - int(lines.line_starts[row]) + 1
    byte = int(lines.data[pos])
    if byte == _CR:
        what = "a carriage return (\\r) that does not end the line"
    elif byte < 32 or byte == 127:
        what = f"control byte 0x{byte:02x}"
    else:
        what = f"non-ASCII byte 0x{byte:02x}"
    return f"{what} at column {column} (not text: Criteo rows are printable ASCII)"


def _detect_labelled(
    lines: _Lines, labelled: bool | None, ctx: _Context, bad_rows: _BadRows, skip: bool
) -> tuple[bool | None, str]:
    """Resolve ``labelled=None`` from the widest row; return (labelled, note for errors).

    When skipping, lines already known to be malformed (not text, empty) do not vote, and if no
    line is left the answer stays None (the next block decides).
    """
    if labelled is not None:
        return bool(labelled), ""
    counts = lines.field_counts
    if skip and bad_rows.mask is not None:
        counts = np.where(bad_rows.mask, 0, counts)
        if not counts.any():
            return None, ""
    widest_row = int(np.argmax(counts))
    widest = int(counts[widest_row])
    if widest >= UNLABELLED_FIELDS:
        is_labelled = widest >= LABELLED_FIELDS
        note = ""
        if int(counts[0]) != widest:
            line = ctx.first_line_number + widest_row
            kind = "labelled" if is_labelled else "unlabelled"
            note = f" (read as {kind} because line {line} has {widest} fields)"
        return is_labelled, note
    if bad_rows.first is not None and not skip:
        raise ctx.error(bad_rows.first[0], bad_rows.first[2])
    raise ctx.error(
        0,
        f"cannot tell whether the rows are labelled: the widest row has {widest} fields "
        f"(labelled rows have {LABELLED_FIELDS}, unlabelled {UNLABELLED_FIELDS}); "
        "pass labelled=True or False",
    )


def _too_many_message(count: int, labelled: bool) -> str:
    if labelled:
        return f"too many fields: {count} (a labelled row has {LABELLED_FIELDS}: label, I1..I13, C1..C26)"
    return f"too many fields: {count} (an unlabelled row has {UNLABELLED_FIELDS}: I1..I13, C1..C26)"


def _field_bounds(lines: _Lines, num_fields: int) -> tuple[np.ndarray, np.ndarray]:
    """Start and end offsets of every field, shape (N, num_fields); absent fields are empty and
    fields beyond ``num_fields`` (of a line with too many, flagged elsewhere) are left out."""
    ends = lines.seps.copy()
    ends[lines.newline_seps] = lines.line_ends  # the last field stops before any '\r'
    starts = np.empty_like(ends)
    starts[0] = _PAD_FRONT
    starts[1:] = lines.seps[:-1] + 1
    num_rows = lines.field_counts.size
    too_many = int(lines.field_counts.max()) > num_fields
    if ends.size == num_rows * num_fields and not too_many:  # every row complete: a plain reshape
        return starts.reshape(num_rows, num_fields), ends.reshape(num_rows, num_fields)
    # Short rows: scatter the fields into an (N, F) grid pre-filled with empty fields that sit at
    # the line end, i.e. pad on the right.
    rows = np.repeat(np.arange(num_rows), lines.field_counts)
    first_field = np.repeat(lines.newline_seps - lines.field_counts + 1, lines.field_counts)
    columns = np.arange(ends.size) - first_field
    if too_many:
        kept = columns < num_fields
        rows, columns, starts, ends = rows[kept], columns[kept], starts[kept], ends[kept]
    grid_starts = np.repeat(lines.line_ends[:, None], num_fields, axis=1)
    grid_ends = grid_starts.copy()
    grid_starts[rows, columns] = starts
    grid_ends[rows, columns] = ends
    return grid_starts, grid_ends


def _parse_labels(
    lines: _Lines, starts: np.ndarray, ends: np.ndarray, ctx: _Context, bad_rows: _BadRows
) -> np.ndarray:
    """The label column: exactly '0' or '1', as float32."""
    first = lines.data[starts]
    ok = (ends - starts == 1) & ((first == ord("0")) | (first == ord("1")))
    bad_rows.add(
        ~ok,
        0,
        lambda r, _: f"label = {ctx.field_text(starts[r], ends[r])} is not 0 or 1{ctx.detection_note}",
    )
    return (first - ord("0")).astype(np.float32) * ok


# ----------------------------------------------------------------------------------------------
# Field decoding, eight bytes at a time
# ----------------------------------------------------------------------------------------------


def _window(lines: _Lines, ends: np.ndarray, num_bytes: np.ndarray) -> np.ndarray:
    """For every field, the ``num_bytes`` (0..8) bytes just before ``ends`` as a uint64 whose
    lower bytes are zeroed: little-endian, so the byte just before ``ends`` is the most
    significant one and the zero padding takes the place of leading zeros."""
    return lines.words[ends - 8] & _KEEP_TOP[num_bytes]


def _has_bad_byte(
    words: np.ndarray, low: int, high: int, also_lowercase: tuple[int, int] | None = None
) -> np.ndarray:
    """Per word: whether a non-zero byte (zeros are padding) lies outside [low, high], and, with
    ``also_lowercase=(lo2, hi2)``, also outside [lo2, hi2] once lowercased.

    Per lane, ``(b | 0x80) - t`` keeps its high bit exactly when b >= t, and setting the high bit
    first means the subtraction never borrows from the neighbouring lane. That is only a valid
    test for bytes < 0x80: a non-ASCII byte may pass for a digit, but its line has already been
    flagged as malformed (see _find_structural_problems), and lanes never mix, so other fields
    are unaffected.
    """
    high_set = words | _HIGH
    ok = (high_set - _LSB * np.uint64(low)) & ~(high_set - _LSB * np.uint64(high + 1))
    if also_lowercase is not None:
        # OR-ing 0x20 lowercases 'A'-'Z' and leaves digits alone.
        folded = high_set | (_LSB * np.uint64(0x20))
        lo2, hi2 = also_lowercase
        ok |= (folded - _LSB * np.uint64(lo2)) & ~(folded - _LSB * np.uint64(hi2 + 1))
    non_zero = high_set - _LSB
    return (non_zero & ~ok & _HIGH) != 0


def _decimal8(words: np.ndarray) -> np.ndarray:
    """Value of up to 8 decimal digits (most significant in the lowest byte, zero-padded).

    Each step multiplies to add every lane, scaled, to its neighbour, then keeps the combined
    lanes: 8 one-digit lanes -> 4 two-digit -> 2 four-digit -> 1 eight-digit value.
    """
    value = ((words & _LOW_NIBBLES) * np.uint64(10 * 2**8 + 1)) >> np.uint64(8)
    value = ((value & _LANES16) * np.uint64(100 * 2**16 + 1)) >> np.uint64(16)
    return ((value & _LANES32) * np.uint64(10_000 * 2**32 + 1)) >> np.uint64(32)


def _hex8(words: np.ndarray) -> np.ndarray:
    """Value of up to 8 hex digits (most significant in the lowest byte, zero-padded)."""
    # '0'-'9' are 0x30-0x39; 'a'-'f' / 'A'-'F' are 0x61-0x66 / 0x41-0x46: bit 6 marks a letter.
    nibbles = (words & _LOW_NIBBLES) + np.uint64(9) * ((words >> np.uint64(6)) & _LSB)
    value = (nibbles * np.uint64(16 * 2**8 + 1)) >> np.uint64(8)  # same steps as _decimal8
    value = ((value & _LANES16) * np.uint64(256 * 2**16 + 1)) >> np.uint64(16)
    return ((value & _LANES32) * np.uint64(65_536 * 2**32 + 1)) >> np.uint64(32)


def _parse_dense(
    lines: _Lines,
    starts: np.ndarray,
    ends: np.ndarray,
    first_field: int,
    dense_transform: str,
    ctx: _Context,
    bad_rows: _BadRows,
) -> np.ndarray:
    """Decode the (N, 13) integer fields and return them transformed (see read_tsv), float32."""
    negative = lines.data[starts] == _MINUS  # an empty field starts on a separator, never '-'
    num_digits = ends - starts - negative
    bad = (negative & (num_digits == 0)) | (num_digits > _MAX_DENSE_DIGITS)
    num_digits = np.minimum(num_digits, _MAX_DENSE_DIGITS)
    value = np.zeros(starts.shape, dtype=np.uint64)
    for k in range(-(-int(num_digits.max(initial=0)) // 8)):  # 8 digits per word, low ones first
        window = _window(lines, ends - 8 * k, np.clip(num_digits - 8 * k, 0, 8))
        bad |= _has_bad_byte(window, ord("0"), ord("9"))
        value += _decimal8(window) * np.uint64(10 ** (8 * k))
    bad_rows.add(
        bad,
        first_field,
        lambda r, j: f"field {DENSE_NAMES[j]} = {ctx.field_text(starts[r, j], ends[r, j])} "
        f"is not an integer (at most {_MAX_DENSE_DIGITS} digits)",
    )
    # float64 first: float32 cannot hold large counts exactly, and the log of the exact count
    # rounds once.
    if dense_transform == "log1p":
        value[negative] = 0  # negative values only matter through max(x, 0)
        return np.log1p(value.astype(np.float64)).astype(np.float32)
    signed = value.astype(np.float64)
    np.negative(signed, out=signed, where=negative)
    return np.log(np.maximum(signed, -2.0) + 3.0).astype(np.float32)


def _parse_sparse(
    lines: _Lines,
    starts: np.ndarray,
    ends: np.ndarray,
    first_field: int,
    moduli: np.ndarray,
    ctx: _Context,
    bad_rows: _BadRows,
) -> np.ndarray:
    """Decode the (N, 26) hex id fields, each modulo its table size, as int64."""
    length = ends - starts
    window = _window(lines, ends, np.minimum(length, _MAX_HEX_DIGITS))
    bad = (length > _MAX_HEX_DIGITS) | _has_bad_byte(window, ord("0"), ord("9"), (ord("a"), ord("f")))
    bad_rows.add(
        bad,
        first_field,
        lambda r, j: f"field {SPARSE_NAMES[j]} = {ctx.field_text(starts[r, j], ends[r, j])} "
        f"is not a hex id (1 to {_MAX_HEX_DIGITS} hex digits)",
    )
    return (_hex8(window) % moduli.astype(np.uint64)).astype(np.int64)
