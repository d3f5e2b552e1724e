"""Where the lines and fields of a block of bytes are, and which lines are malformed as a whole.

A block is copied into a padded array (:func:`_split_lines`) and every separator located at once;
:func:`_field_bounds` turns that into an (N, F) grid of field offsets, padding short rows on the
right. :class:`_BadRows` collects the malformed lines (a mask and the first problem, for the
error message), :class:`_Context` words that message with the file name and line number, and
:func:`_find_structural_problems` flags lines that are not text or are empty.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from app.data.tsv_format import _CR, _LF, _TAB, CriteoFormatError

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
