"""Write click logs of one's own shape as Parquet: named columns, string and integer ids, a list of
the items a user clicked before, a price with missing values, a per-user effect and pairwise
interactions; the worked example of docs/own-data.md.

Columns: ``user_id`` (string, 2,000 users, Zipf-like activity), ``item_id`` (int64, 5,000 items),
``recent_items`` (list of int64 item ids, 0 to 10 a row: the row's user's earlier clicks, drawn from
the 30 items that user favours), ``category`` (string, the item's, 40 of them), ``device`` (string, 3),
``price`` (float64, 5 % null), ``hour`` (int64, 0-23) and ``clicked`` (int8; not in
``predict.parquet``). The click logit, with ``--truth fm`` (the default), is

    -1.2 + user[u] + item[i] + category[c] + device[d] - 0.3 log1p(price) + 0.2 sin(2 pi hour / 24)
         + sum over the pairs {f, g} of (u, i, c, d, r) of <v_f, v_g>

a factorisation machine: a 4-dim latent factor per user, item, category and device, and for the
recent items the mean of their item factors (a row without any: zeros), every pair of the five
multiplied (the user's taste for the item, the item's fit to the user's history, the item on a
device ...). ``--truth additive`` leaves the pairs out: a sum of per-id effects, a logistic
regression's own form. Everything is drawn from the seed; files are identical for the same
arguments. The truth's own AUC and per-user AUC (GAUC) on each file, the most any model can reach,
are printed and kept in the file's key-value metadata (``planted_truth_auc``,
``planted_truth_gauc``). Usage, from the repository root:

    python data/make_own_data.py --output data/own --rows 200000
"""

from __future__ import annotations

import argparse
import sys
from itertools import combinations
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from app.data.synthetic import rank_auc  # noqa: E402
from app.quality.planted import TRUTH_AUC_KEY, TRUTH_GAUC_KEY  # noqa: E402
from app.train.metrics import group_auc  # noqa: E402

USERS, ITEMS, CATEGORIES, DEVICES = 2_000, 5_000, 40, ("ios", "android", "web")
FAVOURITES_PER_USER, MAX_RECENT_ITEMS = 30, 10
FACTOR_DIM = 4  # the rank of each pairwise interaction
FACTOR_STD = 0.45  # with 10 pairs, the interactions' logit spread is about the additive part's
ROW_GROUP_ROWS = 8_192
ITEM_ID_OFFSET = 10_000_000  # item ids as a catalogue writes them (their remainder by 5,000 is the item)
TRUTHS = ("fm", "additive")


def world(seed: int) -> dict[str, np.ndarray]:
    """The planted effects and factors, who is how active and which items each user favours."""
    rng = np.random.default_rng(seed)
    activity = 1.0 / np.arange(1, USERS + 1) ** 0.8
    return {
        "user_share": activity / activity.sum(),
        "user": rng.normal(0.0, 0.8, USERS),
        "item": rng.normal(0.0, 0.5, ITEMS),
        "category_of_item": rng.integers(0, CATEGORIES, ITEMS),
        "category": rng.normal(0.0, 0.4, CATEGORIES),
        "device": np.array([0.2, -0.1, 0.0]),
        "favourites": rng.integers(0, ITEMS, (USERS, FAVOURITES_PER_USER)),
        **{f"{name}_factors": rng.normal(0.0, FACTOR_STD, (count, FACTOR_DIM))
           for name, count in (("user", USERS), ("item", ITEMS), ("category", CATEGORIES), ("device", len(DEVICES)))},
    }  # fmt: skip


def recent_items(truth: dict[str, np.ndarray], user: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Each row's recent items (rows x MAX_RECENT_ITEMS, the first ``lengths`` of a row valid): drawn
    from the row's user's favourites, 0 to MAX_RECENT_ITEMS of them."""
    lengths = rng.integers(0, MAX_RECENT_ITEMS + 1, user.size)
    picks = rng.integers(0, FAVOURITES_PER_USER, (user.size, MAX_RECENT_ITEMS))
    return truth["favourites"][user[:, None], picks], lengths


def true_logits(truth: dict[str, np.ndarray], kind: str, user, item, device, price, hour, recent, lengths) -> np.ndarray:
    """Each row's click logit (the arguments: one array per column, ``recent`` as from :func:`recent_items`)."""
    category = truth["category_of_item"][item]
    logit = (-1.2 + truth["user"][user] + truth["item"][item] + truth["category"][category] + truth["device"][device]
             - 0.3 * np.log1p(price) + 0.2 * np.sin(2 * np.pi * hour / 24))  # fmt: skip
    if kind == "additive":
        return logit
    valid = np.arange(recent.shape[1])[None, :] < lengths[:, None]
    recent_sum = (truth["item_factors"][recent] * valid[:, :, None]).sum(axis=1)
    factors = [truth["user_factors"][user], truth["item_factors"][item], truth["category_factors"][category],
               truth["device_factors"][device], recent_sum / np.maximum(lengths, 1)[:, None]]  # fmt: skip
    return logit + sum((f * g).sum(axis=1) for f, g in combinations(factors, 2))


def rows(
    truth: dict[str, np.ndarray], num_rows: int, seed: int, kind: str
) -> tuple[pa.Table, np.ndarray, np.ndarray, np.ndarray]:
    """One file's rows with their labels, true click probabilities and users."""
    rng = np.random.default_rng(seed)
    user = rng.choice(USERS, num_rows, p=truth["user_share"])
    item = rng.integers(0, ITEMS, num_rows)
    category = truth["category_of_item"][item]
    device = rng.integers(0, len(DEVICES), num_rows)
    price = np.round(rng.lognormal(3.0, 1.0, num_rows), 2)
    hour = rng.integers(0, 24, num_rows)
    recent, lengths = recent_items(truth, user, rng)
    probability = 1.0 / (1.0 + np.exp(-true_logits(truth, kind, user, item, device, price, hour, recent, lengths)))
    clicked = (rng.random(num_rows) < probability).astype(np.int8)
    price_missing = rng.random(num_rows) < 0.05
    valid = np.arange(MAX_RECENT_ITEMS)[None, :] < lengths[:, None]
    offsets = np.r_[0, np.cumsum(lengths)].astype(np.int32)
    table = pa.table({
        "user_id": pa.array([f"user-{u}" for u in user]),
        "item_id": pa.array(item.astype(np.int64) + ITEM_ID_OFFSET),
        "recent_items": pa.ListArray.from_arrays(offsets, pa.array(recent[valid].astype(np.int64) + ITEM_ID_OFFSET)),
        "category": pa.array([f"cat-{c}" for c in category]),
        "device": pa.array(np.array(DEVICES)[device]),
        "price": pa.array(price, mask=price_missing),
        "hour": pa.array(hour.astype(np.int64)),
        "clicked": pa.array(clicked),
    })  # fmt: skip
    return table, clicked, probability, user


def write_files(folder: Path, num_rows: int, seed: int, kind: str = "fm") -> dict[str, dict[str, float]]:
    """train.parquet (``num_rows``), val.parquet (a fifth) and predict.parquet (a tenth, no label) under
    ``folder``; returns each file's rows, click rate and the truth's AUC and GAUC."""
    if kind not in TRUTHS:
        raise ValueError(f"truth = {kind!r} is not one of {', '.join(TRUTHS)}")
    folder.mkdir(parents=True, exist_ok=True)
    truth = world(seed)
    summary = {}
    for offset, (name, count) in enumerate((("train", num_rows), ("val", num_rows // 5), ("predict", num_rows // 10))):
        table, clicked, probability, user = rows(truth, count, seed + 1 + offset, kind)
        figures = {"rows": count, "click_rate": float(clicked.mean()), TRUTH_AUC_KEY: rank_auc(probability, clicked),
                   TRUTH_GAUC_KEY: group_auc(probability, clicked, user)}  # fmt: skip
        if name == "predict":
            table = table.drop_columns(["clicked"])
        metadata = {key: repr(figures[key]) for key in (TRUTH_AUC_KEY, TRUTH_GAUC_KEY)}
        pq.write_table(table.replace_schema_metadata(metadata), folder / f"{name}.parquet", row_group_size=ROW_GROUP_ROWS)
        summary[name] = figures
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="folder for train.parquet, val.parquet and predict.parquet")
    parser.add_argument("--rows", type=int, default=200_000, help="training rows (validation: a fifth, predict: a tenth)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--truth", choices=TRUTHS, default="fm",
                        help="fm: per-id effects and pairwise interactions; additive: per-id effects only")  # fmt: skip
    args = parser.parse_args()
    folder = Path(args.output)
    for name, figures in write_files(folder, args.rows, args.seed, args.truth).items():
        print(f"{folder / name}.parquet: {figures['rows']:,} rows, {figures['click_rate']:.1%} clicks, the truth's AUC "
              f"{figures[TRUTH_AUC_KEY]:.4f}, GAUC {figures[TRUTH_GAUC_KEY]:.4f}")  # fmt: skip


if __name__ == "__main__":
    main()
