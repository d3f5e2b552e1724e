"""One file's blocks, parsed (on a thread pool with several threads) and handed out in file order,
optionally straight into a growing :class:`~app.data.tsv_output._Output`: what comes out, and the
first error raised, are those of the one-thread reader."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from app.data.tsv_format import CriteoArrays, CriteoFormatError, _columns
from app.data.tsv_output import _Output
from app.data.tsv_parse import _parse
from app.data.tsv_stream import _line_blocks

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
    blocks = _line_blocks(path, block_bytes)
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
            for whole, done in zip(_columns(out.arrays), _columns(part)):
                whole[rows] = done  # numpy copies safely between overlapping views
        out.append(part)
    return part


def _finish_all(in_flight: _InFlight, out: _Output | None) -> Iterator[CriteoArrays]:
    """Every parse in flight, oldest first."""
    while in_flight:
        yield _finish_oldest(in_flight, out)
