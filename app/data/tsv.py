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

The reader is split by job: :mod:`app.data.tsv_format` (row layout, result and error types),
:mod:`app.data.paths` (data specs -> files), :mod:`app.data.tsv_stream` (files -> blocks of whole
lines), :mod:`app.data.tsv_pipeline` (blocks parsed on threads, in file order) into
:mod:`app.data.tsv_output`, and :mod:`app.data.tsv_parse` (bytes -> arrays) with
:mod:`app.data.tsv_lines` and :mod:`app.data.tsv_fields`. This module is the public API: every name
is importable from here.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from app.data.paths import DATA_SUFFIXES, expand_paths
from app.data.source import check_table_sizes
from app.data.tsv_format import (
    DENSE_NAMES,
    DENSE_TRANSFORMS,
    LABELLED_FIELDS,
    NUM_DENSE,
    NUM_SPARSE,
    ON_BAD_ROWS,
    SPARSE_NAMES,
    UNLABELLED_FIELDS,
    CriteoArrays,
    CriteoFormatError,
    DenseTransform,
    OnBadRows,
)
from app.data.tsv_output import _Output
from app.data.tsv_parse import _parse
from app.data.tsv_pipeline import _parsed_blocks
from app.data.tsv_stream import MAX_LINE_BYTES

__all__ = [
    "CHUNK_BYTES",
    "DATA_SUFFIXES",
    "DENSE_NAMES",
    "DENSE_TRANSFORMS",
    "LABELLED_FIELDS",
    "MAX_DEFAULT_THREADS",
    "MAX_LINE_BYTES",
    "NUM_DENSE",
    "NUM_SPARSE",
    "ON_BAD_ROWS",
    "SPARSE_NAMES",
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
