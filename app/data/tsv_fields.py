"""Field values, decoded eight bytes at a time: labels, the 13 integer features (transformed) and
the 26 hex ids (modulo their table sizes), each value checked.

An unaligned ``uint64`` view of the block lets one fancy-index gather fetch the (up to) eight bytes
ending at every field's end, and SWAR ("SIMD within a register") bit arithmetic validates and
converts them. Malformed values are flagged in :class:`~app.data.tsv_lines._BadRows`.
"""

from __future__ import annotations

import numpy as np

from app.data.tsv_format import _MINUS, DENSE_NAMES, SPARSE_NAMES
from app.data.tsv_lines import _BadRows, _Context, _Lines

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
