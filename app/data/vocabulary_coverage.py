"""How well ``data.frequency_threshold``'s vocabulary covers the rows a run evaluates or scores: per
feature, the share of ids outside it (every id it does not keep is mapped to the shared id 1), in one
line per split, and a warning when a feature's share says the rows are not the data the vocabulary
was counted over (docs/data.md). A model scoring such rows sees one shared embedding where the ids
were, so its predictions hardly depend on them; nothing else in a run says so.

The ids are counted where they are mapped, exactly (:meth:`Vocabulary.map` counts as it searches):

* cached splits (validate, test, fit's validation): while their days are mapped
  (:func:`app.data.frequency_threshold.mapped_days`), per row range, cut at every standard split's
  bounds so that any split's rows are a sum of whole ranges; the ranges' counts go into the mapped
  folder's ``metadata.json``, where a later run reusing the folder reads them;
* predict: while its raw ids are mapped in memory, over all of them (every rank reads the whole file
  and then takes its own slice), so the report of global rank 0 covers every row.

Hashed ids (``data.frequency_threshold`` 0) are not reported: a hashed table has a row for every id
modulo its size, and what the app keeps does not say which ids training saw (a checkpoint holds no
ids; the cache's per-file distinct ids cover whole files, Kaggle's train.txt with its evaluation
days, and a scoring run's ``data.train`` need not be the model's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, get_args

import numpy as np

from app.criteo import NUM_SPARSE, SPARSE_NAMES
from app.data.preprocess.vocabulary import RARE_ID
from app.data.splits import RowPart, part_rows

SETTING = "data.out_of_vocabulary_warn_share"
# Measured with T = 3, the vocabulary counted over part of the rows and the per-feature share taken
# on other rows: held-out rows of the same data reach at most 0.77 (real Kaggle rows, vocabulary of
# 2,285 of 4,571 rows: C3, whose rare ids dominate a sample that small; 0.15 for 1,024 synthetic rows
# of another seed against 4,096), while rows from another source put most features at 0.97-1.00 (real
# Terabyte rows against that Kaggle vocabulary: 25 of 26 features above 0.9, 97.9 % of all ids; the
# synthetic rows written with other id hashes: 21 of 26). Features often missing stay lower either
# way (an empty field is one frequent id). tests/data/test_vocabulary_coverage.py repeats the first.
DEFAULT_WARN_SHARE = 0.9
METADATA_KEY = "out_of_vocabulary"  # in a mapped folder's metadata.json


@dataclass(frozen=True)
class OutsideCounts:
    """Rows and, per feature, how many of their ids are outside the vocabulary (one id per row and feature)."""

    rows: int
    ids: tuple[int, ...]

    @classmethod
    def of(cls, rows: int, counts: Sequence[int] | np.ndarray) -> "OutsideCounts":
        return cls(int(rows), tuple(int(count) for count in counts))

    @property
    def shares(self) -> list[float]:
        """Per feature, the share of the rows' ids outside the vocabulary (0 for no rows)."""
        return [count / self.rows if self.rows else 0.0 for count in self.ids]

    @property
    def overall_share(self) -> float:
        return sum(self.ids) / (self.rows * len(self.ids)) if self.rows else 0.0


def check_warn_share(share: float) -> float:
    """``share`` if it is a share (0 .. 1), else a ValueError naming the setting."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"{SETTING} = {share} must be within 0 .. 1 (a share of a feature's ids)")
    return share


def count_mapped(mapped_ids: np.ndarray) -> np.ndarray:
    """Per feature, the contiguous ids (rows, 26) that are the shared id 1: ids outside the
    vocabulary, counted from days mapped before (an interrupted mapping's finished days)."""
    return np.count_nonzero(np.asarray(mapped_ids) == RARE_ID, axis=0).astype(np.int64)


# ---- the counts in a mapped folder's metadata.json --------------------------------------------


def row_cuts(num_rows: int) -> list[int]:
    """Every bound of every standard split's rows (:func:`app.data.splits.part_rows`) of ``num_rows``
    rows: row ranges cut there add up to any split's rows exactly."""
    cuts = set()
    for part in get_args(RowPart):
        cuts.update(part_rows(part, num_rows))
    return sorted(cuts)


def to_metadata(ranges: Sequence[tuple[int, int, Sequence[int]]]) -> dict[str, Any]:
    """``(first row, end row, ids outside per feature)`` of each mapped range, as metadata.json keeps them."""
    totals = np.zeros(NUM_SPARSE, dtype=np.int64)
    for _, _, counts in ranges:
        totals += np.asarray(counts, dtype=np.int64)
    return {
        "rows": sum(stop - start for start, stop, _ in ranges),
        "ids_per_feature": totals.tolist(),
        "row_ranges": [
            {"start": start, "stop": stop, "ids_per_feature": [int(count) for count in counts]}
            for start, stop, counts in ranges
        ],
    }


def from_metadata(metadata: dict[str, Any], start: int, stop: int) -> OutsideCounts | None:
    """The counts of rows ``[start, stop)`` of a mapped folder, summed from its metadata.json's ranges;
    None for a folder without them (days not mapped by :mod:`app.data.frequency_threshold`)."""
    recorded = metadata.get(METADATA_KEY)
    if recorded is None:
        return None
    totals = np.zeros(NUM_SPARSE, dtype=np.int64)
    for entry in recorded["row_ranges"]:
        inside = start <= entry["start"] and entry["stop"] <= stop
        assert inside or entry["stop"] <= start or stop <= entry["start"], "ranges are cut at every split's bounds"
        if inside:
            totals += np.asarray(entry["ids_per_feature"], dtype=np.int64)
    return OutsideCounts.of(stop - start, totals)


# ---- the report ---------------------------------------------------------------------------------


def report(where: str, counts: OutsideCounts, threshold: int, warn_share: float) -> None:
    """One line (global rank 0) with each feature's share of ids outside the vocabulary, and a warning
    naming the features whose share is above ``warn_share``."""
    # Here, not at the top: the mapping's worker processes import this module and never need torch.
    from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

    per_feature = ", ".join(f"{name} {share:.2%}" for name, share in zip(SPARSE_NAMES, counts.shares))
    rank_zero_info(
        f"{where}: {counts.rows:,} rows, {counts.overall_share:.2%} of their ids outside the vocabulary of "
        f"data.frequency_threshold = {threshold} (mapped to the shared id 1); per feature: {per_feature}"
    )
    above = [f"{name} {share:.2%}" for name, share in zip(SPARSE_NAMES, counts.shares) if share > warn_share]
    if above:
        rank_zero_warn(
            f"{where}: {len(above)} of {NUM_SPARSE} features have a share of ids outside the vocabulary above "
            f"{SETTING} = {warn_share:g}: {', '.join(above)}. The model sees each of those ids as the one "
            "shared id 1, so its predictions hardly depend on them: are these rows from the data it was trained on "
            "(not another source, day range or id hashing)?"
        )
