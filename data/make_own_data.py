"""Write click logs of one's own shape as Parquet: named columns, string and integer ids, a price
with missing values, a per-user effect; the worked example of docs/own-data.md.

Columns: ``user_id`` (string, 2,000 users, Zipf-like activity), ``item_id`` (int64, 5,000 items),
``category`` (string, the item's, 40 of them), ``device`` (string, 3), ``price`` (float64, 5 % null),
``hour`` (int64, 0-23) and ``clicked`` (int8; not in ``predict.parquet``). The click logit is

    -1.2 + user[u] + item[i] + category[c] + device[d] - 0.3 log1p(price) + 0.2 sin(2 pi hour / 24)

with the user, item and category effects drawn once from the seed; files are identical for the same
arguments, and the Bayes-optimal AUC (the truth's own ranking) is printed per file. Usage, from the
repository root:

    python data/make_own_data.py --output data/own --rows 200000
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from app.data.synthetic import rank_auc  # noqa: E402

USERS, ITEMS, CATEGORIES, DEVICES = 2_000, 5_000, 40, ("ios", "android", "web")
ROW_GROUP_ROWS = 8_192


def world(seed: int) -> dict[str, np.ndarray]:
    """The planted effects and who is how active."""
    rng = np.random.default_rng(seed)
    activity = 1.0 / np.arange(1, USERS + 1) ** 0.8
    return {
        "user_share": activity / activity.sum(),
        "user": rng.normal(0.0, 0.8, USERS),
        "item": rng.normal(0.0, 0.5, ITEMS),
        "category_of_item": rng.integers(0, CATEGORIES, ITEMS),
        "category": rng.normal(0.0, 0.4, CATEGORIES),
        "device": np.array([0.2, -0.1, 0.0]),
    }


def rows(truth: dict[str, np.ndarray], num_rows: int, seed: int) -> tuple[pa.Table, np.ndarray, np.ndarray]:
    """One file's rows with their labels and true click probabilities."""
    rng = np.random.default_rng(seed)
    user = rng.choice(USERS, num_rows, p=truth["user_share"])
    item = rng.integers(0, ITEMS, num_rows)
    category = truth["category_of_item"][item]
    device = rng.integers(0, len(DEVICES), num_rows)
    price = np.round(rng.lognormal(3.0, 1.0, num_rows), 2)
    hour = rng.integers(0, 24, num_rows)
    logit = (-1.2 + truth["user"][user] + truth["item"][item] + truth["category"][category] + truth["device"][device]
             - 0.3 * np.log1p(price) + 0.2 * np.sin(2 * np.pi * hour / 24))  # fmt: skip
    probability = 1.0 / (1.0 + np.exp(-logit))
    clicked = (rng.random(num_rows) < probability).astype(np.int8)
    price_missing = rng.random(num_rows) < 0.05
    table = pa.table({
        "user_id": pa.array([f"user-{u}" for u in user]),
        "item_id": pa.array(item.astype(np.int64) + 10_000_000),
        "category": pa.array([f"cat-{c}" for c in category]),
        "device": pa.array(np.array(DEVICES)[device]),
        "price": pa.array(price, mask=price_missing),
        "hour": pa.array(hour.astype(np.int64)),
        "clicked": pa.array(clicked),
    })  # fmt: skip
    return table, clicked, probability


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="folder for train.parquet, val.parquet and predict.parquet")
    parser.add_argument("--rows", type=int, default=200_000, help="training rows (validation: a fifth, predict: a tenth)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    folder = Path(args.output)
    folder.mkdir(parents=True, exist_ok=True)
    truth = world(args.seed)
    for offset, (name, num_rows) in enumerate((("train", args.rows), ("val", args.rows // 5), ("predict", args.rows // 10))):
        table, clicked, probability = rows(truth, num_rows, args.seed + 1 + offset)
        if name == "predict":
            table = table.drop_columns(["clicked"])
        pq.write_table(table, folder / f"{name}.parquet", row_group_size=ROW_GROUP_ROWS)
        print(f"{folder / name}.parquet: {num_rows:,} rows, {clicked.mean():.1%} clicks, Bayes-optimal AUC "
              f"{rank_auc(probability, clicked):.4f}")  # fmt: skip


if __name__ == "__main__":
    main()
