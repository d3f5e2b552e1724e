"""A data schema shapes the model: exactly its features, tables shared by several columns, per-table dims
and mean pooling, through the data module, the model and a 2-process fit."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from app.data.datamodule import CriteoDataModule
from app.data.parquet.schema import CategoricalColumn, DenseColumn, ParquetSchema
from app.model.dlrm import build_dlrm, build_embedding_bag_collection
from app.train.module import DLRMModule

ROWS = 512
# One dense column and five categorical ones: the item of the row and the items the user clicked before
# share the table "item" (mean-pooled, its own dim), the user and two more have tables of their own; a
# column between the two of "item" makes the batches' feature order differ from the tables'.
SCHEMA = ParquetSchema(
    label="clicked",
    dense=[DenseColumn("price", "log1p", 0.0)],
    categorical=[
        CategoricalColumn("user", "string"),
        CategoricalColumn("item_id", "integer", table="item", dim=4),
        CategoricalColumn("category", "string"),
        CategoricalColumn("clicked_items", "integer", max_length=3, table="item", pooling="mean"),
        CategoricalColumn("hour", "integer"),
    ],
)
NAMES = ["user", "item_id", "category", "clicked_items", "hour"]
SMALL_MODEL = dict(embedding_dim=8, dense_arch_layer_sizes=[8], over_arch_layer_sizes=[8, 1])


def write_clicks(path: Path, rows: int = ROWS, seed: int = 0) -> None:
    """Click logs of the schema's shape; the first row's item is also its only clicked item."""
    rng = np.random.default_rng(seed)
    items = rng.integers(0, 40, rows)
    clicked = [list(map(int, rng.integers(0, 40, rng.integers(0, 5)))) for _ in range(rows)]
    clicked[0] = [int(items[0])]
    table = pa.table({
        "clicked": rng.integers(0, 2, rows), "price": rng.random(rows) * 100,
        "user": [f"u{u}" for u in rng.integers(0, 30, rows)], "item_id": items,
        "clicked_items": pa.array(clicked, pa.list_(pa.int64())),
        "category": [f"c{c}" for c in rng.integers(0, 6, rows)], "hour": rng.integers(0, 24, rows),
    })  # fmt: skip
    pq.write_table(table, path, row_group_size=200)


@pytest.fixture(scope="module")
def clicks(tmp_path_factory) -> dict:
    """The training file, its data module set up (auto table sizes) and its first batch of 64 rows."""
    folder = tmp_path_factory.mktemp("clicks")
    write_clicks(folder / "train.parquet")
    write_clicks(folder / "val.parquet", rows=128, seed=1)
    data = CriteoDataModule(train=str(folder / "train.parquet"), schema=SCHEMA, num_embeddings_per_feature="auto",
                            batch_size=64, shuffle=False, cache_dir=str(folder / "cache"), cache_workers=1)  # fmt: skip
    with pytest.warns(UserWarning, match="lists longer than their data.schema max_length were cut"):
        data.setup("fit")
    return {"folder": folder, "data": data, "batch": next(iter(data.train_dataloader()))}


def test_a_schema_of_n_features_builds_a_model_of_exactly_n_inputs(clicks):
    data, batch = clicks["data"], clicks["batch"]
    assert batch.dense_features.shape == (64, 1)
    assert batch.sparse_features.keys() == NAMES  # by the columns' names, no constant input
    module = DLRMModule(**SMALL_MODEL, interaction="cat", num_embeddings_per_feature=data.model_table_sizes,
                        features=data.model_features)  # fmt: skip
    model = module.model
    assert model.dense_arch.model._mlp[0]._linear.in_features == 1
    tables = {c.name: (c.feature_names, c.embedding_dim, c.pooling.name) for c in model.sparse_arch.embedding_bag_collection.embedding_bag_configs()}  # fmt: skip
    assert tables == {"t_user": (["user"], 8, "SUM"), "t_item": (["item_id", "clicked_items"], 4, "MEAN"),
                      "t_category": (["category"], 8, "SUM"), "t_hour": (["hour"], 8, "SUM")}  # fmt: skip
    # The top MLP takes the bottom MLP's 8, the item table's 4 for each of its two columns and 8 for each other column.
    assert model.over_arch.model[0]._mlp[0]._linear.in_features == 8 + 2 * 4 + 3 * 8


def test_a_shared_table_gives_both_columns_the_same_row_for_the_same_id(clicks):
    data, batch = clicks["data"], clicks["batch"]
    rows = pq.read_table(clicks["folder"] / "train.parquet").to_pydict()
    distinct = len(set(rows["item_id"])) + len({i for items in rows["clicked_items"] for i in items[:3]})
    assert data.model_table_sizes[1] == data.model_table_sizes[3] == distinct  # one size covering both columns' ids
    tables = build_embedding_bag_collection(4, data.model_table_sizes, device="cpu", features=data.model_features)
    pooled = tables(batch.sparse_features).to_dict()
    # Row 0: its item and its one clicked item are the same id, hence the same row of the one table.
    assert batch.sparse_features["clicked_items"].lengths()[0] == 1
    assert torch.equal(pooled["item_id"][0], pooled["clicked_items"][0])
    weight = tables.embedding_bags["t_item"].weight
    assert torch.equal(pooled["item_id"][0], weight[batch.sparse_features["item_id"].values()[0]])


def test_mean_pooling_equals_the_sum_over_the_rows_number_of_ids_on_a_real_batch(clicks):
    data, batch = clicks["data"], clicks["batch"]
    mean = build_embedding_bag_collection(4, data.model_table_sizes, device="cpu", features=data.model_features)
    summed_features = dict(data.model_features, categorical=[dict(c, pooling="sum") for c in data.model_features["categorical"]])
    summed = build_embedding_bag_collection(4, data.model_table_sizes, device="cpu", features=summed_features)
    summed.load_state_dict(mean.state_dict())
    lengths = batch.sparse_features["clicked_items"].lengths()
    assert set(lengths.tolist()) == {0, 1, 2, 3}  # lists cut to 3, empty ones too
    by_mean = mean(batch.sparse_features).to_dict()["clicked_items"]
    by_sum = summed(batch.sparse_features).to_dict()["clicked_items"]
    assert torch.equal(by_mean[lengths > 0], by_sum[lengths > 0] / lengths[lengths > 0, None].float())
    assert torch.equal(by_mean[lengths == 0], torch.zeros_like(by_mean[lengths == 0]))  # no id: nothing to pool


def test_per_table_dims_are_refused_where_the_interaction_takes_one_dim(clicks):
    features, sizes = clicks["data"].model_features, clicks["data"].model_table_sizes
    for interaction in ("dot", "dcn", "projection"):
        with pytest.raises(ValueError, match=rf"data.schema.categorical 'item_id': dim = 4 differs from model.embedding_dim = 8; "
                                             rf"model.interaction = {interaction} takes one dim for every table"):  # fmt: skip
            build_dlrm(interaction=interaction, num_embeddings_per_feature=sizes, features=features, **SMALL_MODEL)
    with pytest.raises(ValueError, match=r"'item_id': dim = 4 .* model.first_order and model.second_order take one dim"):
        DLRMModule(interaction="cat", num_embeddings_per_feature=sizes, features=features, second_order=True, **SMALL_MODEL)
    same_dim = dict(features, categorical=[dict(c, dim=None) for c in features["categorical"]])
    model = build_dlrm(interaction="dot", num_embeddings_per_feature=sizes, features=same_dim, embedding_device="cpu", **SMALL_MODEL)
    batch = clicks["batch"]
    assert model(batch.dense_features, batch.sparse_features).shape == (64, 1)


def test_bad_table_settings_are_refused_naming_the_columns_and_the_setting(clicks):
    item = CategoricalColumn("item_id", "integer", table="item")
    for bad, message in (
        ([CategoricalColumn("x", dim=-2)], r"'x': dim = -2 must be a positive integer"),
        ([CategoricalColumn("x", dim=6)], r"'x': dim = 6 must be a multiple of 4: FBGEMM's embedding kernels"),
        ([CategoricalColumn("x", pooling="max")], r"'x': pooling = 'max' is not one of sum, mean"),
        ([item, CategoricalColumn("clicked", "string", table="item")],
         r"'item_id' and 'clicked' share table 'item' but read ids = integer and string"),
        ([CategoricalColumn("a", table="t", pooling="sum"), CategoricalColumn("b", table="t", pooling="mean")],
         r"'a' and 'b' share table 't' but set pooling = 'sum' and 'mean'"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            ParquetSchema(categorical=bad)
    train = str(clicks["folder"] / "train.parquet")
    with pytest.raises(ValueError, match=r"num_embeddings_per_feature gives 100 rows to 'item_id' and 50 to 'clicked_items', which share table 'item'"):
        CriteoDataModule(train=train, schema=SCHEMA, num_embeddings_per_feature=[10, 100, 10, 50, 10])
    with pytest.raises(ValueError, match=r"has 26 sizes; give 5, one per categorical column of data.schema \(user, item_id"):
        CriteoDataModule(train=train, schema=SCHEMA, num_embeddings_per_feature=[10] * 26)
    with pytest.raises(ValueError, match=r"frequency_threshold = 2 does not apply to table 'item' of data.schema, shared by item_id, clicked_items"):
        CriteoDataModule(train=train, schema=SCHEMA, frequency_threshold=2).check_inputs("fit")
    (clicks["folder"] / "rows.tsv").write_text("0\t1\n")
    with pytest.raises(ValueError, match=r"data.schema names Parquet columns, but data.train holds tsv files"):
        CriteoDataModule(train=str(clicks["folder"] / "rows.tsv"), schema=SCHEMA, num_embeddings_per_feature=10).check_inputs("fit")


def _trained_tables(cli) -> dict:
    module = cli.trainer.lightning_module
    shapes = {name.rsplit(".", 2)[-2]: tuple(t.size()) for name, t in module.state_dict().items() if "embedding_bags" in name}
    return {"shapes": shapes, "features": module.hparams.features, "metrics": {k: float(v) for k, v in cli.trainer.callback_metrics.items()}}


def test_shared_tables_dims_and_mean_pooling_train_on_2_processes(clicks, tmp_path):
    from tests.multiprocess import DEMO_BEFORE_QUALITY_SETTINGS, run_on_ranks

    folder, data = clicks["folder"], clicks["data"]
    schema = {"label": "clicked", "dense": [{"name": "price"}],
              "categorical": [{"name": c.name, "ids": c.ids, "max_length": c.max_length, "table": c.table, "dim": c.dim,
                               "pooling": c.pooling} for c in SCHEMA.categorical]}  # fmt: skip
    args = [
        "fit", "--config", "configs/demo.yaml", *DEMO_BEFORE_QUALITY_SETTINGS, "--data.train", str(folder / "train.parquet"),
        "--data.val", str(folder / "val.parquet"), "--data.test", "null", "--data.predict", "null",
        "--data.schema", json.dumps(schema), "--data.num_embeddings_per_feature", "auto", "--data.batch_size", "64",
        "--data.cache_dir", str(tmp_path / "cache"), "--model.interaction", "cat", "--model.embedding_dim", "8",
        "--model.dense_arch_layer_sizes", "[8]", "--model.over_arch_layer_sizes", "[8, 1]",
        "--trainer.strategy.sharding_types", "[table_wise]", "--trainer.max_epochs", "1", "--trainer.logger", "false",
        "--trainer.enable_checkpointing", "false", "--trainer.enable_progress_bar", "false",
        "--trainer.default_root_dir", str(tmp_path / "run"),
    ]  # fmt: skip
    ranks = run_on_ranks(2, args, tmp_path, _trained_tables)
    sizes = data.model_table_sizes
    expected = {"t_user": (sizes[0], 8), "t_item": (sizes[1], 4), "t_category": (sizes[2], 8), "t_hour": (sizes[4], 8)}
    for rank in ranks:
        assert rank["shapes"] == expected  # the sharded tables (FBGEMM's): one for the item's two columns, of its own dim
        assert rank["features"] == data.model_features  # what a checkpoint's hyper-parameters keep
        assert 0 < rank["metrics"]["val/auc"] < 1 and np.isfinite(rank["metrics"]["val/logloss"])


def test_the_pages_shared_table_example_builds_the_model_it_describes():
    import re

    import yaml

    page = Path("docs/own-data.md").read_text().split("## The schema: `data.schema`", 1)[1]
    config = yaml.safe_load(re.search(r"^```yaml\n(.*?)^```", page, flags=re.M | re.S).group(1))
    schema = config["data"]["schema"]
    schema = ParquetSchema(schema["label"], [DenseColumn(**c) for c in schema["dense"]],
                           [CategoricalColumn(**c) for c in schema["categorical"]])  # fmt: skip
    model = build_dlrm(**config["model"], num_embeddings_per_feature=[100] * 3, dense_arch_layer_sizes=[16],
                       over_arch_layer_sizes=[8, 1], features=schema.model_features())  # fmt: skip
    tables = {c.name: (c.feature_names, c.embedding_dim, c.pooling.name) for c in model.sparse_arch.embedding_bag_collection.embedding_bag_configs()}  # fmt: skip
    assert tables == {"t_user_id": (["user_id"], 16, "SUM"), "t_item": (["item_id", "clicked_items"], 8, "MEAN")}
    assert model.dense_arch.model._mlp[0]._linear.in_features == 1


def test_a_checkpoint_of_other_features_is_refused_naming_the_first_that_differs(clicks):
    from app.checkpoint.saved_model import SavedModel, check_same_features

    features = clicks["data"].model_features
    saved = SavedModel("runs/own/last.ckpt", {"features": features})
    check_same_features(saved, features)
    summed = dict(features, categorical=[dict(c, pooling="sum") for c in features["categorical"]])
    with pytest.raises(ValueError, match=r"data.schema gives the model other features than ckpt_path runs/own/last.ckpt holds: "
                                         r"'item_id' \(table 'item', dim 4, pooling mean\) there, 'item_id' \(table 'item', dim 4, pooling sum\) here"):  # fmt: skip
        check_same_features(saved, summed)
    with pytest.raises(ValueError, match=r"holds: Criteo's 13 dense and 26 categorical features there, dense 'price' here"):
        check_same_features(SavedModel("criteo.ckpt", {}), features)  # a checkpoint from before features were kept
