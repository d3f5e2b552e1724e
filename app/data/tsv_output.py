"""Where :func:`app.data.tsv.read_tsv_files` puts its rows: arrays allocated once from an
estimate of the final row count and parsed into in place, so the result is never held twice."""

from __future__ import annotations

from collections.abc import Sequence

from app.data.tsv_format import CriteoArrays, _columns, _empty_arrays


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
