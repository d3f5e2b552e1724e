"""Decoding a block of raw Criteo TSV lines (bytes) into arrays: what a row is (label, I1..I13,
C1..C26), the result (:class:`CriteoArrays`) and the error (:class:`CriteoFormatError`), and the
vectorised decoder :func:`parse_block`, with no per-row Python loop.

Format (docs/data.md): one sample per line, tab-separated ``label, I1..I13, C1..C26`` (40 fields),
or ``I1..I13, C1..C26`` (39 fields) for unlabelled files. An empty field is a missing value. Files
in the wild strip trailing empty fields, so a short row is padded with empty fields *on the right*
(never aligned from the right-hand end) -- but a row must keep at least the label and the 13 dense
fields (:data:`MIN_LABELLED_FIELDS`; 13 without a label): anything shorter is a cut-off line.

How a block is decoded, top to bottom in this file:

1. Lines: the block is copied into a padded array and every separator located at once
   (:func:`_split_lines`); :func:`_field_bounds` turns that into an (N, F) grid of field offsets.
2. Fields: an unaligned ``uint64`` view of the block lets one fancy-index gather fetch the (up to)
   eight bytes ending at every field's end, and SWAR ("SIMD within a register") bit arithmetic
   validates and converts them (labels, the 13 integer features transformed, the 26 hex ids
   modulo their table sizes).
3. Rows: malformed lines are collected in :class:`_BadRows` (a mask and the first problem); the
   first one raises, or with ``on_bad_rows="skip"`` they are dropped and counted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from app.criteo import DENSE_NAMES, NUM_DENSE, NUM_SPARSE, SPARSE_NAMES
from app.data.source import RowBlock

LABELLED_FIELDS = 1 + NUM_DENSE + NUM_SPARSE  # 40
UNLABELLED_FIELDS = NUM_DENSE + NUM_SPARSE  # 39


OnBadRows = Literal["error", "skip"]
DenseTransform = Literal["log1p", "log_plus_3"]
ON_BAD_ROWS: tuple[str, ...] = ("error", "skip")
DENSE_TRANSFORMS: tuple[str, ...] = ("log1p", "log_plus_3")

# The fewest fields a row may have: trailing empty categorical fields may be stripped, but a row
# without all of I1..I13 (and the label) is a line cut off, not a sparse row.
MIN_LABELLED_FIELDS = 1 + NUM_DENSE  # 14
MIN_UNLABELLED_FIELDS = NUM_DENSE  # 13

_TAB, _LF, _CR, _MINUS = 9, 10, 13, 45


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
            return CriteoArrays.empty(0)
        return CriteoArrays(
            dense=np.concatenate([p.dense for p in parts]),
            sparse=np.concatenate([p.sparse for p in parts]),
            labels=np.concatenate([p.labels for p in parts]),
            num_bad_rows=sum(p.num_bad_rows for p in parts),
            first_bad_row=next((p.first_bad_row for p in parts if p.first_bad_row), None),
        )

    @staticmethod
    def empty(num_rows: int) -> "CriteoArrays":
        """Uninitialised arrays for ``num_rows`` rows."""
        return _empty_arrays(num_rows)

    def columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(dense, sparse, labels)``."""
        return self.dense, self.sparse, self.labels


def _empty_arrays(num_rows: int) -> CriteoArrays:
    """Uninitialised arrays for ``num_rows`` rows."""
    return CriteoArrays(
        dense=np.empty((num_rows, NUM_DENSE), np.float32),
        sparse=np.empty((num_rows, NUM_SPARSE), np.int64),
        labels=np.empty((num_rows,), np.float32),
    )


# ----------------------------------------------------------------------------------------------
# 1. Lines: where the lines and fields of a block are, and which lines are malformed as a whole
# ----------------------------------------------------------------------------------------------

# Zero bytes in front of the data, so that the 8-byte windows ending at any field end (up to
# three of them for an 18-digit value) never start before the array.
_PAD_FRONT = 24


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


# ----------------------------------------------------------------------------------------------
# 2. Fields: values decoded eight bytes at a time, each checked
# ----------------------------------------------------------------------------------------------

# Longest accepted dense value: 18 digits always fit in int64 (19 may not).
_MAX_DENSE_DIGITS = 18
_MAX_HEX_DIGITS = 8

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


# ----------------------------------------------------------------------------------------------
# 3. Rows: a whole block, its labelled/unlabelled detection and its malformed lines
# ----------------------------------------------------------------------------------------------


def parse_block(
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
    """Decode whole lines of raw Criteo TSV (the final newline may be missing); also return
    whether they were read as labelled (the auto-detection result, still None when ``labelled``
    was None and every line was dropped as malformed).

    ``first_line_number`` (1-based) and ``source`` (the file name) only serve error messages.
    ``moduli`` are the 26 table sizes (int64). With ``out``, the rows are written to
    ``out[out_row:]`` and views of them are returned. Malformed lines raise
    :class:`CriteoFormatError` for the first one, or are dropped with ``on_bad_rows="skip"``.
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
    min_fields = MIN_LABELLED_FIELDS if labelled else MIN_UNLABELLED_FIELDS
    bad_rows.add(
        lines.field_counts < min_fields,
        _RANK_TOO_MANY,
        lambda r, _: _too_few_message(int(lines.field_counts[r]), labelled),
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


def _too_few_message(count: int, labelled: bool) -> str:
    needed = "the label and I1..I13" if labelled else "I1..I13"
    minimum = MIN_LABELLED_FIELDS if labelled else MIN_UNLABELLED_FIELDS
    return (
        f"too few fields: {count} (a row needs at least {minimum}: {needed}; only trailing empty "
        "C fields may be left out): the line is cut off"
    )
