"""Deterministic Criteo-format click logs with a planted, learnable signal.

The rows look like raw Criteo TSV (docs/data.md): ``label, I1..I13, C1..C26``
tab-separated (no label column when unlabelled); integer features are heavy-tailed counts, some
missing, I2 sometimes small negatives like the real I2; categorical ids are 8 lowercase hex digits
(a fixed random 32-bit hash per vocabulary id) with Zipf-like frequencies, vocabularies from 3
to 100k ids, and some features often missing.

The click probability is ``sigmoid(true_logit + noise)``, where ``true_logit`` sums

* random per-id effects of 14 categorical features (popular ids are seen often enough to learn),
* three dense effects, linear in ``log1p(max(x, 0))`` (the reader's transform),
* one pairwise interaction, C6 x C14, of rank 2 (what DLRM's dot products can express),

and the noise is an unobserved Gaussian. Ranking by ``true_logit`` is Bayes-optimal, so its AUC
on the written rows is the best any model can reach (about 0.80); the intercept gives ~25 %
positives.

Everything that defines the signal -- vocabularies, hashes, effects -- comes from a fixed world
seed; ``seed`` only drives the sampling of rows. So files written with different seeds share
the same signal (train on one, validate on another), and a file is byte-identical for the same
``(num_rows, seed)`` (given this numpy version and CPU: the floating-point transcendentals are
numpy's own).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import numpy as np

from app.criteo import NUM_DENSE, NUM_SPARSE

# The "world": change it and every generated file, and the planted signal, change.
WORLD_SEED = 20_240_601

# Vocabulary size per categorical feature: the Kaggle cardinalities' shape, capped at 100k.
VOCAB_SIZES = (
    1_000, 500, 100_000, 50_000, 300, 24, 10_000, 600, 3, 30_000, 5_000, 80_000, 3_000,
    27, 10_000, 60_000, 10, 5_000, 2_000, 4, 70_000, 18, 15, 20_000, 100, 20_000,
)
# Zipf exponent of the id frequencies (id of rank r drawn with probability ~ 1 / r ** a). Steep for
# the large vocabularies: with flatter tails most rows carry ids seen only once or twice, which a
# DLRM memorises from the second epoch on (val AUC then falls); this way it keeps improving.
ZIPF_EXPONENTS = (
    1.4, 1.0, 1.7, 1.7, 1.0, 0.8, 1.4, 1.0, 0.6, 1.7, 1.4, 1.7, 1.4,
    0.8, 1.4, 1.7, 0.7, 1.4, 1.4, 0.5, 1.7, 0.8, 0.8, 1.7, 0.9, 1.7,
)
# Probability that a categorical field is empty (C19-C26 are often missing in the real data).
SPARSE_MISSING = (
    0.0, 0.0, 0.02, 0.02, 0.0, 0.1, 0.0, 0.0, 0.0, 0.0, 0.0, 0.02, 0.0,
    0.0, 0.0, 0.02, 0.0, 0.0, 0.4, 0.4, 0.0, 0.75, 0.0, 0.02, 0.4, 0.4,
)
# Standard deviation of the per-id logit effect; 0 = the feature carries no signal.
SPARSE_EFFECT_STD = (
    0.36, 0.36, 0.43, 0.0, 0.29, 0.36, 0.0, 0.29, 0.22, 0.0, 0.36, 0.0, 0.29,
    0.36, 0.0, 0.0, 0.29, 0.0, 0.0, 0.22, 0.0, 0.0, 0.29, 0.0, 0.29, 0.0,
)
# Integer features: (missing probability, mu, sigma) of a count floor(exp(N(mu, sigma))) - 1.
DENSE_SPECS = (
    (0.45, 0.7, 1.2), (0.0, 2.0, 2.0), (0.2, 2.0, 1.5), (0.2, 1.8, 1.0), (0.03, 7.5, 2.0),
    (0.22, 4.0, 1.8), (0.04, 2.0, 1.5), (0.0, 2.3, 1.0), (0.04, 4.0, 1.4), (0.45, 0.4, 0.5),
    (0.04, 1.0, 0.9), (0.76, 0.3, 1.0), (0.2, 1.8, 1.0),
)
I2_NEGATIVE_PROBABILITY = 0.1  # I2 is then -1, -2 or -3, as in the Kaggle data
MAX_DENSE_VALUE = 999_999_999
# Logit effect per unit of log1p(max(x, 0)), by dense feature index (0 = I1).
DENSE_EFFECTS = {0: 0.22, 6: -0.14, 10: 0.18}
INTERACTION_FEATURES = (5, 13)  # C6 x C14
INTERACTION_RANK = 2
INTERACTION_SCALE = 0.43
NOISE_STD = 0.5  # unobserved per-row logit noise
INTERCEPT = -1.43  # tuned so that about 25 % of the rows are clicks


@dataclass(frozen=True)
class _World:
    """Everything fixed by WORLD_SEED."""

    cdfs: tuple[np.ndarray, ...]  # per feature: cumulative Zipf probabilities over ids
    hex_ids: tuple[np.ndarray, ...]  # per feature: (V, 8) uint8, the id's hash as hex text
    # Indexed by id, with one extra trailing zero entry so that id -1 (missing) means "no effect".
    effects: tuple[np.ndarray, ...]  # per feature: (V + 1,) float64 logit effect per id
    interaction: tuple[np.ndarray, np.ndarray]  # (V_a + 1, R) and (V_b + 1, R) factors


@dataclass
class SyntheticRows:
    """Sampled rows before formatting (missing values are flagged, not yet empty fields)."""

    dense: np.ndarray  # int64 (N, 13); meaningless where dense_missing
    dense_missing: np.ndarray  # bool (N, 13)
    ids: np.ndarray  # int64 (N, 26): vocabulary index, -1 = missing
    true_logits: np.ndarray  # float64 (N,): the noise-free logit, Bayes-optimal score
    labels: np.ndarray  # int8 (N,)


@dataclass(frozen=True)
class SyntheticSummary:
    """What ``write_synthetic_criteo`` wrote."""

    num_rows: int
    positives: int
    positive_rate: float
    bayes_auc: float  # AUC of the true logits on these rows' labels (hidden ones if unlabelled)


@functools.lru_cache(maxsize=1)
def _world() -> _World:
    rng = np.random.default_rng(WORLD_SEED)
    cdfs, hex_ids, effects = [], [], []
    for size, exponent, effect_std in zip(VOCAB_SIZES, ZIPF_EXPONENTS, SPARSE_EFFECT_STD):
        weights = 1.0 / np.arange(1, size + 1) ** exponent
        cdf = np.cumsum(weights / weights.sum())
        cdf[-1] = 1.0
        cdfs.append(cdf)
        hex_ids.append(_hex_text(_unique_hashes(rng, size)))
        effect = rng.normal(0.0, effect_std, size) if effect_std else np.zeros(size)
        effects.append(np.append(effect, 0.0))
    a, b = (
        np.vstack([rng.normal(0.0, 1.0, (VOCAB_SIZES[f], INTERACTION_RANK)), np.zeros(INTERACTION_RANK)])
        for f in INTERACTION_FEATURES
    )
    return _World(tuple(cdfs), tuple(hex_ids), tuple(effects), (a, b))


@functools.lru_cache(maxsize=2)
def _other_hex_ids(id_hash: int) -> tuple[np.ndarray, ...]:
    """Per feature, the hex text of each vocabulary id under hash ``id_hash`` (not the world's own)."""
    rng = np.random.default_rng([WORLD_SEED, 0, id_hash])  # never the world's stream, nor a row sample's
    return tuple(_hex_text(_unique_hashes(rng, size)) for size in VOCAB_SIZES)


def vocabulary_hex_ids() -> tuple[np.ndarray, ...]:
    """Per categorical feature, the hex text written for each vocabulary id: (V, 8) uint8 (index = id).

    For readers that map a written file back to the generator's ids (the quality bench's Bayes-optimal AUC).
    """
    return _world().hex_ids


def _unique_hashes(rng: np.random.Generator, count: int) -> np.ndarray:
    """``count`` distinct random 32-bit values, so that two ids never share a hash."""
    values = rng.integers(0, 2**32, count + count // 8 + 16, dtype=np.uint64)
    _, first = np.unique(values, return_index=True)
    distinct = values[np.sort(first)]  # keep draw order: the result stays a random sequence
    assert distinct.size >= count, "too many hash collisions (cannot happen for <= 100k ids)"
    return distinct[:count]


def _hex_text(values: np.ndarray) -> np.ndarray:
    """(V,) uint32 values -> (V, 8) uint8 lowercase hex digits."""
    shifts = np.arange(28, -4, -4, dtype=np.uint64)
    nibbles = (values[:, None] >> shifts) & np.uint64(15)
    return np.frombuffer(b"0123456789abcdef", dtype=np.uint8)[nibbles]


def sample_rows(num_rows: int, seed: int) -> SyntheticRows:
    """Draw ``num_rows`` rows (features, true logits and labels) from the world with ``seed``."""
    world = _world()
    rng = np.random.default_rng([WORLD_SEED, seed])  # keyed by both: never the world's stream
    ids = np.empty((num_rows, NUM_SPARSE), dtype=np.int64)
    for j, cdf in enumerate(world.cdfs):
        ids[:, j] = np.minimum(np.searchsorted(cdf, rng.random(num_rows), side="right"), cdf.size - 1)
        ids[rng.random(num_rows) < SPARSE_MISSING[j], j] = -1
    dense, dense_missing = _sample_dense(rng, num_rows)
    logits = true_logits(ids, dense, dense_missing)
    noisy = logits + rng.normal(0.0, NOISE_STD, num_rows)
    labels = (rng.random(num_rows) < 1.0 / (1.0 + np.exp(-noisy))).astype(np.int8)
    return SyntheticRows(dense, dense_missing, ids, logits, labels)


def _sample_dense(rng: np.random.Generator, num_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Heavy-tailed counts (log-normal, floored) and their missing flags, both (N, 13)."""
    dense = np.empty((num_rows, NUM_DENSE), dtype=np.int64)
    missing = np.empty((num_rows, NUM_DENSE), dtype=bool)
    for k, (missing_rate, mu, sigma) in enumerate(DENSE_SPECS):
        counts = np.floor(np.exp(rng.normal(mu, sigma, num_rows))) - 1.0
        dense[:, k] = np.clip(counts, 0, MAX_DENSE_VALUE).astype(np.int64)
        missing[:, k] = rng.random(num_rows) < missing_rate
    negative = rng.random(num_rows) < I2_NEGATIVE_PROBABILITY
    dense[negative, 1] = -rng.integers(1, 4, int(negative.sum()))
    return dense, missing


def true_logits(ids: np.ndarray, dense: np.ndarray, dense_missing: np.ndarray) -> np.ndarray:
    """The noise-free click logit of rows, from what the file shows (missing = no effect)."""
    world = _world()
    logits = np.full(ids.shape[0], INTERCEPT)
    for j, effect in enumerate(world.effects):
        if SPARSE_EFFECT_STD[j]:
            logits += effect[ids[:, j]]  # id -1 picks the trailing 0
    for k, weight in DENSE_EFFECTS.items():
        shown = np.where(dense_missing[:, k], 0, np.maximum(dense[:, k], 0))
        logits += weight * np.log1p(shown.astype(np.float64))
    (fa, fb), (a, b) = INTERACTION_FEATURES, world.interaction
    logits += INTERACTION_SCALE * (a[ids[:, fa]] * b[ids[:, fb]]).sum(axis=1)  # 0 if either missing
    return logits


def true_click_probability(ids: np.ndarray, dense: np.ndarray, dense_missing: np.ndarray) -> np.ndarray:
    """P(click | the row's visible features), averaging the unobserved logit noise out.

    Monotone in :func:`true_logits`, so both rank rows identically (same, Bayes-optimal, AUC).
    """
    logits = true_logits(ids, dense, dense_missing)
    # E[sigmoid(l + e)], e ~ N(0, s^2): the probit approximation is accurate to ~1e-2 here.
    return 1.0 / (1.0 + np.exp(-logits / np.sqrt(1.0 + np.pi * NOISE_STD**2 / 8.0)))


def rank_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """ROC AUC via the rank-sum (Mann-Whitney) statistic; tied scores share their mean rank."""
    scores = np.asarray(scores, dtype=np.float64)
    positive = np.asarray(labels) > 0.5
    num_pos = int(positive.sum())
    num_neg = positive.size - num_pos
    if num_pos == 0 or num_neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="stable")
    sorted_scores = scores[order]
    # Average rank (1-based) of each run of equal scores.
    run_starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    run_ends = np.r_[run_starts[1:], scores.size]
    run_rank = (run_starts + run_ends + 1) / 2.0
    ranks = np.empty(scores.size)
    ranks[order] = np.repeat(run_rank, run_ends - run_starts)
    return float((ranks[positive].sum() - num_pos * (num_pos + 1) / 2.0) / (num_pos * num_neg))


# ----------------------------------------------------------------------------------------------
# Writing TSV, vectorised: every row is laid out in fixed-width slots of a byte matrix, with a
# mask of the bytes in use; matrix[mask] drops the unused ones, giving the rows back to back.
# ----------------------------------------------------------------------------------------------

_DENSE_WIDTH = 12  # three 4-digit groups: room for MAX_DENSE_VALUE's 9 digits, or a '-'
_DIGIT_QUADS = np.frombuffer("".join(f"{i:04d}" for i in range(10_000)).encode(), dtype="<u4")
_POWERS_OF_TEN = 10 ** np.arange(1, 10)  # thresholds of 2, 3, ... 10 digits
# Rows formatted at a time: small enough that the byte matrices (~0.8 MB) stay in the CPU cache.
_FORMAT_ROWS = 2_048


def write_synthetic_criteo(
    path: str | os.PathLike, num_rows: int, seed: int, labelled: bool = True, id_hash: int = 0
) -> SyntheticSummary:
    """Write ``num_rows`` synthetic rows to ``path`` (40 fields, or 39 if not ``labelled``).

    The rows are the same either way; unlabelled files just omit the label column (the summary
    still reports the hidden labels). Returns the row count, positives and Bayes-optimal AUC.

    ``id_hash``: 0 writes each categorical id as the world's hash; another value writes the same
    rows with another random 32-bit hash per id, as another source logs the same kind of values
    (Criteo's Kaggle and Terabyte ids never overlap): next to no id of such a file matches one
    written with another ``id_hash`` (only empty fields, and chance collisions of 32-bit values).
    """
    if num_rows <= 0:
        raise ValueError(f"num_rows must be positive, got {num_rows}")
    rows = sample_rows(num_rows, seed)
    hex_ids = _world().hex_ids if id_hash == 0 else _other_hex_ids(id_hash)
    with open(path, "wb") as out:
        for start in range(0, num_rows, _FORMAT_ROWS):
            part = slice(start, min(start + _FORMAT_ROWS, num_rows))
            out.write(_format_rows(rows, part, hex_ids, labelled))
    positives = int(rows.labels.sum())
    return SyntheticSummary(
        num_rows=num_rows,
        positives=positives,
        positive_rate=positives / num_rows,
        bayes_auc=rank_auc(rows.true_logits, rows.labels),
    )


def _format_rows(rows: SyntheticRows, part: slice, hex_ids: tuple[np.ndarray, ...], labelled: bool) -> bytes:
    """The TSV text of ``rows[part]``: label slot, 13 dense slots, 26 id slots, each + separator."""
    n = rows.labels[part].size
    dense_text, dense_used = _decimal_text(rows.dense[part], rows.dense_missing[part])
    ids = rows.ids[part]
    sparse_text = np.empty((n, NUM_SPARSE, 9), dtype=np.uint8)
    for j in range(NUM_SPARSE):
        sparse_text[:, j, :8] = hex_ids[j][ids[:, j]]  # -1 (missing) is masked out below
    sparse_text[:, :, 8] = ord("\t")
    sparse_text[:, -1, 8] = ord("\n")
    sparse_used = np.ones(sparse_text.shape, dtype=bool)
    sparse_used[:, :, :8] = (ids >= 0)[:, :, None]
    blocks = [(dense_text.reshape(n, -1), dense_used.reshape(n, -1))]
    blocks.append((sparse_text.reshape(n, -1), sparse_used.reshape(n, -1)))
    if labelled:
        label_text = np.empty((n, 2), dtype=np.uint8)
        label_text[:, 0] = ord("0") + rows.labels[part]
        label_text[:, 1] = ord("\t")
        blocks.insert(0, (label_text, np.ones((n, 2), dtype=bool)))
    text = np.concatenate([t for t, _ in blocks], axis=1)
    in_use = np.concatenate([u for _, u in blocks], axis=1)
    return text[in_use].tobytes()


def _decimal_text(values: np.ndarray, missing: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Decimal text of int64 ``values`` (n, k), right-aligned in _DENSE_WIDTH-byte slots that are
    each followed by a tab: (text, in use), both (n, k, _DENSE_WIDTH + 1); missing -> empty.

    Right alignment lets the digits come from three lookups of four-digit groups (leading zeros
    are then simply not in use), instead of one division per digit.
    """
    magnitude = np.abs(values)
    groups = np.stack([magnitude // 10**8, magnitude // 10**4 % 10**4, magnitude % 10**4], axis=-1)
    text = np.empty(values.shape + (_DENSE_WIDTH + 1,), dtype=np.uint8)
    text[..., :-1] = _DIGIT_QUADS[groups].view(np.uint8).reshape(values.shape + (_DENSE_WIDTH,))
    text[..., -1] = ord("\t")
    num_digits = 1 + np.searchsorted(_POWERS_OF_TEN, magnitude, side="right")
    first_used = _DENSE_WIDTH - num_digits - (values < 0)  # one more byte for a '-'
    rows, columns = np.nonzero(values < 0)
    text[rows, columns, first_used[rows, columns]] = ord("-")
    in_use = np.ones(text.shape, dtype=bool)
    in_use[..., :-1] = (np.arange(_DENSE_WIDTH) >= first_used[..., None]) & ~missing[..., None]
    return text, in_use
