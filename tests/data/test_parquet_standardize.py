"""``transform: standardize``: the cached days hold (x - mean) / std with the training rows' mean and
std, every split is standardised with those, a checkpoint's state carries them (a later run scores
without the training files), and a column without spread is refused naming it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from app.data.datamodule import CriteoDataModule
from app.data.parquet.schema import CategoricalColumn, DenseColumn, ParquetSchema
from app.data.parquet.statistics import STATISTICS_KEY

SCHEMA = ParquetSchema(
    label="clicked",
    dense=[DenseColumn("price", "standardize", fill=2.5), DenseColumn("visits", "log1p", fill=0.0)],
    categorical=[CategoricalColumn("user")],
)


def write_rows(path: Path, num_rows: int, seed: int, price: np.ndarray | None = None) -> np.ndarray:
    """Rows with a price (10 % null) and returns the price as the conversion fills it (float64)."""
    rng = np.random.default_rng(seed)
    price = rng.lognormal(3.0, 1.0, num_rows) if price is None else price
    nulls = rng.random(num_rows) < 0.1
    columns = {
        "clicked": rng.integers(0, 2, num_rows), "price": pa.array(price, mask=nulls),
        "visits": rng.integers(0, 50, num_rows), "user": [f"u{i % 37}" for i in range(num_rows)],
    }  # fmt: skip
    pq.write_table(pa.table(columns), path, row_group_size=300)  # several row groups: chunks merged
    return np.where(nulls, 2.5, price)


def cached_dense(cache: Path, name: str) -> np.ndarray:
    (folder,) = cache.glob(f"{name}-*[0-9a-f]")  # the split's days, not the statistics beside them
    return np.concatenate([np.load(day) for day in sorted(folder.glob("day_*_dense.npy"))])


def data_module(tmp_path: Path, cache: str, **splits) -> CriteoDataModule:
    return CriteoDataModule(**splits, format="parquet", schema=SCHEMA, num_embeddings_per_feature=100, batch_size=64,
                            cache_dir=str(tmp_path / cache), cache_workers=1)  # fmt: skip


def test_standardized_columns_hold_the_training_rows_z_scores_in_every_split_and_travel_with_the_state(tmp_path):
    train = [write_rows(tmp_path / f"part-{i}.parquet", 1_000 + 200 * i, seed=i) for i in range(2)]
    val = write_rows(tmp_path / "val.parquet", 500, seed=9)
    data = data_module(tmp_path, "cache", train=str(tmp_path / "part-*.parquet"), val=str(tmp_path / "val.parquet"))
    data.setup("fit")
    price = np.concatenate(train)  # the training rows only, as numpy computes their mean and std
    mean, std = price.mean(), price.std()
    assert data.dense_statistics["price"] == pytest.approx([mean, std], rel=1e-12)
    assert set(data.dense_statistics) == {"price"}  # log1p's column needs none
    # One float32 rounding of (x - mean) / std, against numpy's figures: equal up to that rounding's last bit.
    np.testing.assert_array_max_ulp(cached_dense(tmp_path / "cache", "part")[:, 0], ((price - mean) / std).astype(np.float32), maxulp=1)
    val_days = cached_dense(tmp_path / "cache", "val")
    np.testing.assert_array_max_ulp(val_days[:, 0], ((val - mean) / std).astype(np.float32), maxulp=1)
    visits = pq.read_table(tmp_path / "val.parquet")["visits"].to_numpy()
    assert np.array_equal(val_days[:, 1], np.log1p(visits.astype(np.float64)).astype(np.float32))

    # A checkpoint's state carries them: validating from it reads no training file, and converts the
    # validation rows as training did, bit for bit.
    state = data.state_dict()
    assert state[STATISTICS_KEY] == data.dense_statistics
    scored = data_module(tmp_path, "other-cache", val=str(tmp_path / "val.parquet"))
    with pytest.raises(ValueError, match=r"data.schema.dense \(price\): transform standardize takes its mean and std from "
                                         r"the training rows: set data.train for this stage too, or give --ckpt_path"):  # fmt: skip
        scored.check_inputs("validate")
    scored.load_state_dict(state)
    scored.check_inputs("validate")
    scored.setup("validate")
    assert np.array_equal(cached_dense(tmp_path / "other-cache", "val"), val_days)
    other = dict(state, **{STATISTICS_KEY: {"price": [0.0, 1.0]}})
    with pytest.raises(ValueError, match=r"the checkpoint's dense statistics .* differ from those counted over data.train"):
        data.load_state_dict(other)


def test_a_standardized_column_whose_training_values_are_all_equal_is_refused_naming_it(tmp_path):
    write_rows(tmp_path / "train.parquet", 400, seed=1, price=np.full(400, 7.0))  # its nulls filled with 2.5
    pq.write_table(pq.read_table(tmp_path / "train.parquet").drop_null(), tmp_path / "train.parquet")  # all 7.0
    data = data_module(tmp_path, "cache", train=str(tmp_path / "train.parquet"))
    with pytest.raises(ValueError, match=r"data.schema.dense 'price': transform standardize divides by the standard deviation of "
                                         r"the training rows, and their \d+ values all equal 7 \(std 0\); use transform none"):  # fmt: skip
        data.setup("fit")
