"""A block of whole lines (bytes) -> :class:`~app.data.tsv_format.CriteoArrays`, by vectorised
numpy with no per-row Python loop: split the lines (:mod:`app.data.tsv_lines`), tell labelled from
unlabelled rows, decode the fields (:mod:`app.data.tsv_fields`), then raise for the first
malformed line or drop the malformed ones (``on_bad_rows="skip"``)."""

from __future__ import annotations

import numpy as np

from app.data.tsv_fields import _parse_dense, _parse_labels, _parse_sparse
from app.data.tsv_format import (
    LABELLED_FIELDS,
    NUM_SPARSE,
    UNLABELLED_FIELDS,
    CriteoArrays,
    CriteoFormatError,
    _empty_arrays,
)
from app.data.tsv_lines import (
    _RANK_TOO_MANY,
    _BadRows,
    _Context,
    _field_bounds,
    _find_structural_problems,
    _Lines,
    _split_lines,
)


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
