"""Write Criteo-format train/val files whose click truth is a factorization machine: data to tune recipes on.

Another shape than the bundled sample (app/data/synthetic.py), so that a recipe is not tuned to one
generator: the click logit is

    intercept + sum_f w_f[id_f] + sum_{f<g} <v_f[id_f], v_g[id_g]> + sum_k u_k log1p(max(x_k, 0))

with first-order effects w on about 70 % of the 26 features, rank-``rank`` factors v on ``fm_features`` of
them, vocabularies of 4 to 200,000 ids with flat Zipf tails (many ids seen once or twice in 300k rows),
and the label drawn from sigmoid(logit) with no other noise. Everything comes from ``world``; files are
byte-identical for the same arguments. The Bayes-optimal AUC (the truth's own ranking) is printed per
file. Usage, from the repository root (docs/quality.md):

    python data/make_planted_fm.py --output data/planted_fm
    python -m app.quality --train data/planted_fm/train.tsv --val data/planted_fm/val.tsv
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from app.criteo import NUM_DENSE, NUM_SPARSE  # noqa: E402
from app.data.synthetic import rank_auc  # noqa: E402

VOCAB_CHOICES = (4, 10, 30, 100, 500, 2_000, 10_000, 50_000, 200_000)
VOCAB_WEIGHTS = (0.08, 0.08, 0.08, 0.12, 0.12, 0.14, 0.14, 0.12, 0.12)
INTERCEPT = -1.3  # about 26 % clicks


@dataclass(frozen=True)
class World:
    """The planted truth: vocabularies, their hex ids, and every effect."""

    cdfs: list[np.ndarray]  # per feature: cumulative Zipf probabilities over ids
    hex_ids: list[np.ndarray]  # per feature: the id's 8-hex-digit text
    first_order: list[np.ndarray]  # per feature: (V + 1,) effect per id; the last entry (missing) is 0
    factors: list[np.ndarray]  # per feature: (V + 1, rank) factors, zero for features outside the FM
    dense_weights: np.ndarray  # (13,) effect per unit of log1p(max(x, 0))


def make_world(seed: int, rank: int, fm_features: int, zipf_exponents: tuple[float, float]) -> World:
    rng = np.random.default_rng(seed)
    sizes = rng.choice(VOCAB_CHOICES, size=NUM_SPARSE, p=VOCAB_WEIGHTS)
    exponents = rng.uniform(*zipf_exponents, NUM_SPARSE)
    first_std = np.where(rng.random(NUM_SPARSE) < 0.7, rng.uniform(0.1, 0.5, NUM_SPARSE), 0.0)
    in_fm = set(rng.choice(NUM_SPARSE, size=fm_features, replace=False).tolist())
    cdfs, hex_ids, first_order, factors = [], [], [], []
    for j, size in enumerate(sizes):
        weights = 1.0 / np.arange(1, size + 1) ** exponents[j]
        cdf = np.cumsum(weights / weights.sum())
        cdf[-1] = 1.0
        cdfs.append(cdf)
        first_order.append(np.append(rng.normal(0.0, first_std[j], size), 0.0))
        scale = 0.6 / np.sqrt(rank) if j in in_fm else 0.0
        factors.append(np.vstack([rng.normal(0.0, 1.0, (size, rank)) * scale, np.zeros(rank)]))
        hex_ids.append(np.array([f"{v:08x}" for v in rng.choice(2**32, size, replace=False)]))
    dense_weights = np.where(rng.random(NUM_DENSE) < 0.4, rng.normal(0.0, 0.15, NUM_DENSE), 0.0)
    return World(cdfs, hex_ids, first_order, factors, dense_weights)


def sample(world: World, num_rows: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(ids with -1 = missing, dense counts with -1 = missing, true logits, labels) of ``num_rows`` rows."""
    rng = np.random.default_rng(seed)
    ids = np.empty((num_rows, NUM_SPARSE), dtype=np.int64)
    for j, cdf in enumerate(world.cdfs):
        ids[:, j] = np.minimum(np.searchsorted(cdf, rng.random(num_rows), side="right"), cdf.size - 1)
        ids[rng.random(num_rows) < (0.1 if j > 18 else 0.01), j] = -1  # the last features often missing
    dense = np.floor(np.exp(rng.normal(1.5, 1.5, (num_rows, NUM_DENSE)))).astype(np.int64) - 1
    dense[rng.random((num_rows, NUM_DENSE)) < 0.15] = -1
    logits = np.full(num_rows, INTERCEPT)
    for j in range(NUM_SPARSE):
        logits += world.first_order[j][ids[:, j]]
    vectors = np.stack([world.factors[j][ids[:, j]] for j in range(NUM_SPARSE)], axis=1)  # (N, 26, rank)
    summed = vectors.sum(axis=1)
    logits += 0.5 * ((summed * summed).sum(axis=1) - (vectors * vectors).sum(axis=(1, 2)))  # pairwise dots
    dense_effect = np.log1p(np.maximum(dense, 0)) @ world.dense_weights
    logits += dense_effect - dense_effect.mean()
    labels = (rng.random(num_rows) < 1.0 / (1.0 + np.exp(-logits))).astype(np.int8)
    return ids, dense, logits, labels


def write_tsv(world: World, path: Path, ids: np.ndarray, dense: np.ndarray, labels: np.ndarray) -> None:
    with open(path, "w") as out:
        for row in range(labels.size):
            fields = [str(labels[row])] + ["" if x < 0 else str(x) for x in dense[row]]
            fields += ["" if i < 0 else world.hex_ids[j][i] for j, i in enumerate(ids[row])]
            out.write("\t".join(fields) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, required=True, help="folder for train.tsv and val.tsv")
    parser.add_argument("--train_rows", type=int, default=300_000)
    parser.add_argument("--val_rows", type=int, default=50_000)
    parser.add_argument("--world", type=int, default=7, help="seed of the planted truth")
    parser.add_argument("--rank", type=int, default=4, help="rank of the FM's factors")
    parser.add_argument("--fm_features", type=int, default=12, help="features with factors (of 26)")
    parser.add_argument("--zipf", type=float, nargs=2, default=(0.9, 1.3), help="range of the id frequency exponents")
    args = parser.parse_args(argv)
    if not 0 <= args.fm_features <= NUM_SPARSE or args.rank < 1 or min(args.train_rows, args.val_rows) < 1:
        parser.error("need 0 <= --fm_features <= 26, --rank >= 1 and positive row counts")
    world = make_world(args.world, args.rank, args.fm_features, tuple(args.zipf))
    args.output.mkdir(parents=True, exist_ok=True)
    for name, num_rows, seed in (("val", args.val_rows, 2), ("train", args.train_rows, 1)):
        ids, dense, logits, labels = sample(world, num_rows, seed)
        write_tsv(world, args.output / f"{name}.tsv", ids, dense, labels)
        print(f"{args.output / name}.tsv: {num_rows:,} rows, {labels.mean():.1%} clicks, "
              f"Bayes-optimal AUC {rank_auc(logits, labels):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
