"""The best AUC any model can reach on rows that app/data/synthetic.py wrote (the bundled sample), or
that a Parquet file's writer recorded for its rows (data/make_own_data.py).

The generator plants a true click logit and exposes it for rows it has just sampled
(``synthetic.true_logits``), not for a file it wrote earlier. Here a file is read back with the
app's TSV reader, each row's ids mapped back to the generator's vocabulary and its dense counts
recovered, and the generator's own ``true_logits`` scores the rows: ranking by them is
Bayes-optimal, so their AUC against the file's labels is the ceiling for those rows. A file whose
ids are not the generator's (real data, another generator) has no such ceiling: None.

Nothing here changes the generator or what it writes.

A Parquet file may carry its planted truth's AUC and GAUC in its key-value metadata
(``planted_truth_auc``, ``planted_truth_gauc``, as Python writes a float), computed by its writer on
exactly its rows; :func:`recorded_truth` reads them.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from app.criteo import NUM_DENSE, NUM_SPARSE
from app.data.splits import RowPart, part_rows
from app.data.synthetic import rank_auc, true_logits, vocabulary_hex_ids
from app.data.tsv import CriteoArrays, OnBadRows, iter_tsv_chunks, read_tsv_files

# Table sizes that leave the reader's 32-bit hashed ids as they are written (id mod 2**32 = id).
_RAW_ID_SIZES = [2**32] * NUM_SPARSE
# The reader turns a missing id into 0, and no id of the generator's world hashes to 0
# (tests/quality/test_quality_bench.py checks it), so 0 means missing.
_MISSING_ID = 0


@functools.lru_cache(maxsize=1)
def world_id_hashes() -> tuple[np.ndarray, ...]:
    """Per categorical feature, the 32-bit value written for each vocabulary id (index = id), uint64.

    The generator keeps them as hex text only (what it writes); decoded here with numpy.
    """
    hashes = []
    for hex_text in vocabulary_hex_ids():
        digits = hex_text.astype(np.int64)
        nibbles = np.where(digits >= ord("a"), digits - ord("a") + 10, digits - ord("0")).astype(np.uint64)
        shifts = np.arange(28, -4, -4, dtype=np.uint64)
        hashes.append((nibbles << shifts).sum(axis=1, dtype=np.uint64))
    return tuple(hashes)


def vocabulary_ids(raw_ids: np.ndarray) -> np.ndarray | None:
    """The generator's vocabulary index (N, 26) of each raw 32-bit id (N, 26), -1 where missing;
    None when an id is not in the generator's vocabulary (rows it did not write)."""
    ids = np.full(raw_ids.shape, -1, dtype=np.int64)
    for j, hashes in enumerate(world_id_hashes()):
        order = np.argsort(hashes)
        sorted_hashes = hashes[order]
        column = raw_ids[:, j].astype(np.uint64)
        present = column != _MISSING_ID
        position = np.minimum(np.searchsorted(sorted_hashes, column[present]), sorted_hashes.size - 1)
        if not np.array_equal(sorted_hashes[position], column[present]):
            return None
        ids[present, j] = order[position]
    return ids


def dense_counts(log1p_dense: np.ndarray) -> np.ndarray:
    """The counts (N, 13) behind the reader's ``log1p`` values (log(max(x, 0) + 1) in float32):
    ``rint(expm1(v))``, negatives and missing values as 0 (where the truth gives them no effect).

    Exact for counts below about 2**19, where float32 still tells log1p(x) from log1p(x + 1); the
    features that enter the truth (synthetic.DENSE_EFFECTS) are drawn far below that.
    """
    return np.rint(np.expm1(log1p_dense.astype(np.float64))).astype(np.int64)


def planted_logits(rows: CriteoArrays) -> np.ndarray | None:
    """The generator's true logit of each row (read with raw ids and ``log1p`` dense values), or None
    for rows whose ids the generator did not write."""
    ids = vocabulary_ids(rows.sparse)
    if ids is None:
        return None
    dense = dense_counts(rows.dense)
    # A missing count reads as 0, which is what the truth gives a missing value: no effect.
    return true_logits(ids, dense, np.zeros((len(rows), NUM_DENSE), dtype=bool))


def bayes_optimal_auc(
    paths: Sequence[str | Path], part: RowPart = "all", on_bad_rows: OnBadRows = "error"
) -> float | None:
    """The AUC of the planted truth on the labelled rows of raw TSV ``paths`` (the rows ``part`` of
    them, as the data module takes them), or None if the rows are not the generator's.

    The first block of the first file decides, so real data costs one block, not a whole read.
    """
    paths = [Path(p) for p in paths]
    head, _ = next(iter_tsv_chunks(paths[0], _RAW_ID_SIZES, on_bad_rows=on_bad_rows), (None, 0))
    if head is None or len(head) == 0 or (head.labels < 0).any() or vocabulary_ids(head.sparse) is None:
        return None
    rows = read_tsv_files(paths, _RAW_ID_SIZES, labelled=True, on_bad_rows=on_bad_rows, dense_transform="log1p")
    start, stop = part_rows(part, len(rows))
    logits = planted_logits(rows)
    if logits is None:
        return None
    return rank_auc(logits[start:stop], rows.labels[start:stop])


# The key-value metadata a Parquet file's writer records its planted truth's figures under.
TRUTH_AUC_KEY, TRUTH_GAUC_KEY = "planted_truth_auc", "planted_truth_gauc"


def recorded_truth(paths: Sequence[str | Path], part: RowPart = "all") -> tuple[float | None, float | None]:
    """The planted truth's (AUC, GAUC) that one whole Parquet file records for its rows; (None, None)
    for several files or a part of one (the figures are the whole file's), or a file without them."""
    if len(paths) != 1 or part != "all":
        return None, None
    metadata = pq.read_schema(paths[0]).metadata or {}
    auc, gauc = (metadata.get(key.encode()) for key in (TRUTH_AUC_KEY, TRUTH_GAUC_KEY))
    return (None if auc is None else float(auc)), (None if gauc is None else float(gauc))
