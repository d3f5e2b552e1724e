"""Fast, strict reader for raw Criteo TSV click logs (Kaggle ``train.txt``/``test.txt``, Terabyte days).

Format (see docs/criteo-formats.md, section 1): one sample per line, tab-separated
``label, I1..I13, C1..C26`` (40 fields), or ``I1..I13, C1..C26`` (39 fields) for unlabelled files.
An empty field is a missing value. Files in the wild strip trailing empty fields, so a short row is
padded with empty fields *on the right* (never aligned from the right-hand end).

Nothing is skipped silently: every malformed line raises :class:`CriteoFormatError` whose message
starts with ``"<file>:<line>: "`` (1-based), naming the field and value at fault.

The hot path is vectorised numpy over the whole buffer; there is no per-row Python loop.
Field values are decoded eight bytes at a time: an unaligned ``uint64`` view of the buffer
lets one fancy-index gather fetch the (up to) eight bytes ending at every field's end, and
SWAR ("SIMD within a register") bit arithmetic validates and converts them.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from app.data.source import RowBlock

NUM_DENSE = 13
NUM_SPARSE = 26
LABELLED_FIELDS = 1 + NUM_DENSE + NUM_SPARSE  # 40
UNLABELLED_FIELDS = NUM_DENSE + NUM_SPARSE  # 39

DENSE_NAMES = tuple(f"I{i}" for i in range(1, NUM_DENSE + 1))
SPARSE_NAMES = tuple(f"C{i}" for i in range(1, NUM_SPARSE + 1))

# read_tsv parses a file in pieces of whole lines of about this size. The temporary arrays of a
# piece are several times its size; keeping them in the CPU caches is measurably faster (16 MiB
# pieces were ~1.5x slower), while much smaller pieces pay numpy's per-call overhead too often.
CHUNK_BYTES = 512 * 1024

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

    dense: float32 (N, 13), ``log1p(max(x, 0))``; missing -> 0.
    sparse: int64 (N, 26), the 32-bit hex id modulo ``num_embeddings_per_feature[j]``; missing -> 0.
    labels: float32 (N,), 0/1; -1 for rows of an unlabelled (39-field) file.
    """

    dense: np.ndarray
    sparse: np.ndarray
    labels: np.ndarray

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
        """Concatenate row-wise, in the given order (an empty sequence gives zero rows)."""
        if len(parts) == 1:
            return parts[0]
        if not parts:
            return _empty_arrays(0)
        return CriteoArrays(
            dense=np.concatenate([p.dense for p in parts]),
            sparse=np.concatenate([p.sparse for p in parts]),
            labels=np.concatenate([p.labels for p in parts]),
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
) -> CriteoArrays:
    """Read one raw Criteo TSV file.

    ``labelled=None`` auto-detects from the field count: 40 fields -> labelled, 39 -> unlabelled.
    Because trailing empty fields may be stripped, the widest row of the first chunk decides
    (a labelled file whose first row lost its empty C26 still has 40-field rows further down).
    """
    path = Path(path)
    buf = path.read_bytes()  # one read; a streaming reader can feed parse_tsv_bytes instead
    source = str(path)
    if not buf:
        raise CriteoFormatError(f"{source}:1: file is empty (no rows)")
    # Every line becomes a row (or an error), so the output can be allocated up front and each
    # chunk written in place, instead of concatenating the parts at the end.
    chunks = _whole_line_chunks(buf, CHUNK_BYTES)
    line_feeds = sum(np.count_nonzero(np.frombuffer(chunk, dtype=np.uint8) == _LF) for chunk in chunks)
    out = _empty_arrays(line_feeds + (not buf.endswith(b"\n")))
    next_row = 0
    for chunk in chunks:
        part, labelled = _parse(
            chunk, next_row + 1, source, num_embeddings_per_feature, labelled, out, next_row
        )
        next_row += len(part)
    return out


def read_tsv_files(
    paths: Sequence[str | os.PathLike],
    num_embeddings_per_feature: Sequence[int],
    labelled: bool | None = None,
) -> CriteoArrays:
    """Read several files and concatenate their rows in the given order.

    With ``labelled=None`` each file is auto-detected, and mixing labelled with unlabelled
    files is an error (their labels could not be used together).
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    parts: list[CriteoArrays] = []
    first_kind: tuple[str, bool] | None = None
    for path in paths:
        part = read_tsv(path, num_embeddings_per_feature, labelled)
        is_labelled = bool(len(part) == 0 or part.labels[0] != -1)
        if first_kind is None:
            first_kind = (str(path), is_labelled)
        elif is_labelled != first_kind[1]:
            kind = {True: "labelled", False: "unlabelled"}
            raise CriteoFormatError(
                f"{path}:1: file is {kind[is_labelled]} but {first_kind[0]} is "
                f"{kind[first_kind[1]]}; labelled and unlabelled files cannot be mixed"
            )
        parts.append(part)
    return CriteoArrays.concat(parts)


def expand_paths(spec: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    """Resolve a data spec into a list of files.

    ``spec`` is a file, a glob pattern, a directory (its ``*.tsv`` and ``*.txt`` files, sorted by
    name) or a list of those (expanded in order). Raises FileNotFoundError naming the spec when
    something matches nothing.
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
        found = sorted(p for p in path.iterdir() if p.suffix in (".tsv", ".txt") and p.is_file())
        if not found:
            raise FileNotFoundError(f"data directory {text!r} contains no *.tsv or *.txt files")
        return found
    if path.is_file():
        return [path]
    if glob.has_magic(text):
        found = sorted(Path(p) for p in glob.glob(text, recursive=True) if os.path.isfile(p))
        if not found:
            raise FileNotFoundError(f"no data files match the pattern {text!r}")
        return found
    raise FileNotFoundError(f"data file or directory {text!r} does not exist")


def parse_tsv_bytes(
    buf: bytes | bytearray | memoryview,
    first_line_number: int,
    source: str,
    num_embeddings_per_feature: Sequence[int],
    labelled: bool | None,
) -> CriteoArrays:
    """Parse whole lines of raw Criteo TSV (the final newline may be missing).

    ``first_line_number`` is the 1-based line number of the first line in ``buf`` and ``source``
    the file name; both only serve error messages, so a streaming reader can call this per chunk.
    """
    return _parse(buf, first_line_number, source, num_embeddings_per_feature, labelled)[0]


def _whole_line_chunks(buf: bytes, chunk_bytes: int) -> list[memoryview]:
    """Split ``buf`` into zero-copy views of about ``chunk_bytes``, each ending after a newline."""
    view = memoryview(buf)
    chunks = []
    start = 0
    while start < len(buf):
        end = buf.rfind(b"\n", start, start + chunk_bytes) + 1
        if end <= start:  # a line longer than chunk_bytes: take it whole
            end = buf.find(b"\n", start + chunk_bytes) + 1 or len(buf)
        if len(buf) - end < chunk_bytes // 8:  # don't leave a tiny tail chunk
            end = len(buf)
        chunks.append(view[start:end])
        start = end
    return chunks


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


def _parse(
    buf: bytes | bytearray | memoryview,
    first_line_number: int,
    source: str,
    num_embeddings_per_feature: Sequence[int],
    labelled: bool | None,
    out: CriteoArrays | None = None,
    out_row: int = 0,
) -> tuple[CriteoArrays, bool]:
    """Parse ``buf``; also return whether it was read as labelled (the auto-detection result).

    With ``out``, the rows are written to ``out[out_row:]`` and views of them are returned.
    """
    moduli = _check_moduli(num_embeddings_per_feature)
    if len(buf) == 0:
        raise CriteoFormatError(f"{source}:{first_line_number}: empty input (no rows)")
    lines = _split_lines(buf)
    ctx = _Context(source, first_line_number, lines)
    structural = _first_structural_problem(lines)  # (row, message) or None
    labelled, ctx.detection_note = _detect_labelled(lines, labelled, ctx, structural)
    num_fields = LABELLED_FIELDS if labelled else UNLABELLED_FIELDS
    too_many = np.flatnonzero(lines.field_counts > num_fields)
    if too_many.size and (structural is None or too_many[0] < structural[0]):
        row = int(too_many[0])
        structural = (row, _too_many_message(int(lines.field_counts[row]), labelled))
    if structural is not None:
        row, message = structural
        if row > 0:  # an earlier line may hold a value error: report the first bad line
            prefix_end = int(lines.line_starts[row]) - _PAD_FRONT
            _parse(buf[:prefix_end], first_line_number, source, moduli, labelled)
        raise ctx.error(row, message)

    num_rows = lines.field_counts.size
    if out is None:
        out, out_row = _empty_arrays(num_rows), 0
    rows = slice(out_row, out_row + num_rows)
    result = CriteoArrays(out.dense[rows], out.sparse[rows], out.labels[rows])
    starts, ends = _field_bounds(lines, num_fields)  # (N, F): row-major keeps gathers sequential
    errors: list[tuple[int, int, str]] = []  # the first (row, field, message) of each kind
    first_dense = num_fields - UNLABELLED_FIELDS
    first_sparse = num_fields - NUM_SPARSE
    if labelled:
        result.labels[:] = _parse_labels(lines, starts[:, 0], ends[:, 0], ctx, errors)
    else:
        result.labels[:] = -1.0
    dense_fields = slice(first_dense, first_sparse)
    result.dense[:] = _parse_dense(
        lines, starts[:, dense_fields], ends[:, dense_fields], first_dense, ctx, errors
    )
    sparse_fields = slice(first_sparse, num_fields)
    result.sparse[:] = _parse_sparse(
        lines, starts[:, sparse_fields], ends[:, sparse_fields], first_sparse, moduli, ctx, errors
    )
    if errors:
        row, _, message = min(errors)
        raise ctx.error(row, message)
    return result, labelled


def _check_moduli(num_embeddings_per_feature: Sequence[int]) -> np.ndarray:
    moduli = np.asarray(num_embeddings_per_feature, dtype=np.int64)
    if moduli.shape != (NUM_SPARSE,) or (moduli <= 0).any():
        raise ValueError(
            f"num_embeddings_per_feature must be {NUM_SPARSE} positive table sizes, "
            f"got {list(num_embeddings_per_feature)!r}"
        )
    return moduli


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


def _first_structural_problem(lines: _Lines) -> tuple[int, str] | None:
    """The first line that is not text, has a stray '\\r', or is empty: (row, message)."""
    body = lines.data[_PAD_FRONT:]
    # uint8 wrap-around: (b - 32) > 94 holds for control bytes, DEL and non-ASCII bytes.
    not_printable = np.count_nonzero((body - np.uint8(32)) > 94)
    problems: list[tuple[int, str]] = []
    if not_printable != lines.seps.size + np.count_nonzero(lines.has_cr):
        problems.append(_first_bad_byte(lines))
    empty = np.flatnonzero(lines.line_ends == lines.line_starts)
    if empty.size:
        problems.append((int(empty[0]), "empty line (blank lines are not allowed)"))
    return min(problems) if problems else None


def _first_bad_byte(lines: _Lines) -> tuple[int, str]:
    """Locate the first byte that is not printable ASCII, tab, or the '\\r' of a '\\r\\n'."""
    data = lines.data
    bad = (data - np.uint8(32)) > 94
    bad[: _PAD_FRONT] = False
    bad[lines.seps] = False
    bad[lines.line_ends[lines.has_cr]] = False
    pos = int(np.flatnonzero(bad)[0])
    row = int(np.searchsorted(lines.seps[lines.newline_seps], pos))
    column = pos - int(lines.line_starts[row]) + 1
    byte = int(data[pos])
    if byte == _CR:
        what = "a carriage return (\\r) that does not end the line"
    elif byte < 32 or byte == 127:
        what = f"control byte 0x{byte:02x}"
    else:
        what = f"non-ASCII byte 0x{byte:02x}"
    return row, f"{what} at column {column} (not text: Criteo rows are printable ASCII)"


def _detect_labelled(
    lines: _Lines, labelled: bool | None, ctx: _Context, structural: tuple[int, str] | None
) -> tuple[bool, str]:
    """Resolve ``labelled=None`` from the widest row; return (labelled, note for errors)."""
    if labelled is not None:
        return bool(labelled), ""
    widest_row = int(np.argmax(lines.field_counts))
    widest = int(lines.field_counts[widest_row])
    if widest >= UNLABELLED_FIELDS:
        is_labelled = widest >= LABELLED_FIELDS
        note = ""
        if int(lines.field_counts[0]) != widest:
            line = ctx.first_line_number + widest_row
            kind = "labelled" if is_labelled else "unlabelled"
            note = f" (read as {kind} because line {line} has {widest} fields)"
        return is_labelled, note
    if structural is not None:
        raise ctx.error(*structural)
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
    """Start and end offsets of every field, shape (N, num_fields); absent fields are empty."""
    ends = lines.seps.copy()
    ends[lines.newline_seps] = lines.line_ends  # the last field stops before any '\r'
    starts = np.empty_like(ends)
    starts[0] = _PAD_FRONT
    starts[1:] = lines.seps[:-1] + 1
    num_rows = lines.field_counts.size
    if ends.size == num_rows * num_fields:  # no short rows (none are too long): a plain reshape
        return starts.reshape(num_rows, num_fields), ends.reshape(num_rows, num_fields)
    # Short rows: scatter the fields into an (N, F) grid pre-filled with empty fields that sit at
    # the line end, i.e. pad on the right.
    rows = np.repeat(np.arange(num_rows), lines.field_counts)
    first_field = np.repeat(lines.newline_seps - lines.field_counts + 1, lines.field_counts)
    columns = np.arange(ends.size) - first_field
    grid_starts = np.repeat(lines.line_ends[:, None], num_fields, axis=1)
    grid_ends = grid_starts.copy()
    grid_starts[rows, columns] = starts
    grid_ends[rows, columns] = ends
    return grid_starts, grid_ends


def _note_first_error(
    bad: np.ndarray, first_field: int, message: Callable[[int, int], str], errors: list
) -> None:
    """Record the first bad (row, column) of a block of fields as (row, field, message)."""
    if not bad.any():  # the usual case: one fast flat scan
        return
    first = int(np.argmax(bad.ravel()))  # row-major, so the first bad row's first bad column
    row, column = divmod(first, bad.shape[1]) if bad.ndim == 2 else (first, 0)
    errors.append((row, first_field + column, message(row, column)))


def _parse_labels(
    lines: _Lines, starts: np.ndarray, ends: np.ndarray, ctx: _Context, errors: list
) -> np.ndarray:
    """The label column: exactly '0' or '1', as float32."""
    first = lines.data[starts]
    ok = (ends - starts == 1) & ((first == ord("0")) | (first == ord("1")))
    _note_first_error(
        ~ok,
        0,
        lambda r, _: f"label = {ctx.field_text(starts[r], ends[r])} is not 0 or 1{ctx.detection_note}",
        errors,
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

    Bytes must be < 0x80 (guaranteed: non-ASCII input is rejected first). Per lane, ``(b | 0x80)
    - t`` keeps its high bit exactly when b >= t, and setting the high bit first means the
    subtraction never borrows from the neighbouring lane.
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
    ctx: _Context,
    errors: list,
) -> np.ndarray:
    """Decode the (N, 13) integer fields and return ``log1p(max(x, 0))`` as float32."""
    negative = lines.data[starts] == _MINUS  # an empty field starts on a separator, never '-'
    num_digits = ends - starts - negative
    bad = (negative & (num_digits == 0)) | (num_digits > _MAX_DENSE_DIGITS)
    num_digits = np.minimum(num_digits, _MAX_DENSE_DIGITS)
    value = np.zeros(starts.shape, dtype=np.uint64)
    for k in range(-(-int(num_digits.max(initial=0)) // 8)):  # 8 digits per word, low ones first
        window = _window(lines, ends - 8 * k, np.clip(num_digits - 8 * k, 0, 8))
        bad |= _has_bad_byte(window, ord("0"), ord("9"))
        value += _decimal8(window) * np.uint64(10 ** (8 * k))
    _note_first_error(
        bad,
        first_field,
        lambda r, j: f"field {DENSE_NAMES[j]} = {ctx.field_text(starts[r, j], ends[r, j])} "
        f"is not an integer (at most {_MAX_DENSE_DIGITS} digits)",
        errors,
    )
    # Negative values only matter through max(x, 0). float64 first: float32 cannot hold large
    # counts exactly, and the log of the exact count rounds once.
    value[negative] = 0
    return np.log1p(value.astype(np.float64)).astype(np.float32)


def _parse_sparse(
    lines: _Lines,
    starts: np.ndarray,
    ends: np.ndarray,
    first_field: int,
    moduli: np.ndarray,
    ctx: _Context,
    errors: list,
) -> np.ndarray:
    """Decode the (N, 26) hex id fields, each modulo its table size, as int64."""
    length = ends - starts
    window = _window(lines, ends, np.minimum(length, _MAX_HEX_DIGITS))
    bad = (length > _MAX_HEX_DIGITS) | _has_bad_byte(window, ord("0"), ord("9"), (ord("a"), ord("f")))
    _note_first_error(
        bad,
        first_field,
        lambda r, j: f"field {SPARSE_NAMES[j]} = {ctx.field_text(starts[r, j], ends[r, j])} "
        f"is not a hex id (1 to {_MAX_HEX_DIGITS} hex digits)",
        errors,
    )
    return (_hex8(window) % moduli.astype(np.uint64)).astype(np.int64)
