"""Streaming a file on disk as blocks of whole lines: plain or gzip (decompressed as it is read),
never held in memory as a whole, with the line number each block starts at. An empty file, a
damaged gzip stream and an overlong line raise :class:`~app.data.tsv_decode.CriteoFormatError`.
What the lines mean is :mod:`app.data.tsv_decode`'s job."""

from __future__ import annotations

import contextlib
import gzip
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from app.data.tsv_decode import CriteoFormatError

# A valid row is under 600 bytes (13 dense values of at most 19 characters, 26 ids of at most 8).
# A "line" this long without a newline means the file is not Criteo text; refusing it keeps the
# memory of the block reader bounded.
MAX_LINE_BYTES = 1024 * 1024

_GZIP_MAGIC = b"\x1f\x8b"
_NEWLINE = 10
# What a damaged gzip stream raises: truncation (EOFError), bad header/CRC/length (BadGzipFile),
# corrupt deflate data (zlib.error).
_GZIP_ERRORS = (EOFError, gzip.BadGzipFile, zlib.error)


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
class LineBlock:
    """Whole lines of a file."""

    first_line: int  # 1-based number of the first line
    data: bytes  # the lines, each with its newline (but the file's last line may lack it)
    num_lines: int
    fraction_read: float  # how far into the file on disk (compressed, for gzip) reading has got


def line_blocks(path: Path, block_bytes: int) -> Iterator[LineBlock]:
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
            yield LineBlock(lines_done + 1, block, num_lines, fraction_read)
            lines_done += num_lines
            pending, pending_bytes = [data[cut:]], len(data) - cut
    if pending_bytes:
        yield LineBlock(lines_done + 1, b"".join(pending), 1, 1.0)
    elif lines_done == 0:
        raise CriteoFormatError(f"{source}:1: file is empty (no rows)")


def _count_newlines(data: bytes) -> int:
    # numpy's vectorised compare-and-count is about 3x faster than bytes.count here.
    return int(np.count_nonzero(np.frombuffer(data, dtype=np.uint8) == _NEWLINE))


def _read_block(stream: BinaryIO, size: int, source: str, lines_done: int) -> bytes:
    """Up to ``size`` bytes; a damaged gzip stream becomes a CriteoFormatError naming the file."""
    try:
        return stream.read(size)
    except _GZIP_ERRORS as exc:
        raise CriteoFormatError(
            f"{source}:{max(lines_done, 1)}: gzip stream is truncated or corrupt after "
            f"{lines_done} complete lines ({exc})"
        ) from exc
