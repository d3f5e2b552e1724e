"""The data layout a checkpoint records and what the pt2 export does with it: a schema's ``transform: none``
and integer ids lowered, string ids, list columns and multi-hot days refused before any compile; export
files that prove they are intact (a damaged model file or package refused in one line)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from torchrec.datasets.criteo import DEFAULT_CAT_NAMES
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from app.checkpoint.export import export_checkpoint
from app.checkpoint.export import main as export_main
from app.checkpoint.export_pt2 import build_serving_module, contract, read_saved_weights
from app.checkpoint.saved_model import read_saved_model
from app.data.layout import criteo_layout, training_layout
from app.data.parquet.schema import CategoricalColumn, DenseColumn, ParquetSchema
from app.model.dlrm import build_dlrm, build_dlrm_arguments
from tests.serve.models import write_model_file

HASHED_SIZES = [40, 60] + [300] * 24

# A schema of 4 dense and 2 categorical columns, read into a model of Criteo's shape (13 dense inputs, 26 tables).
SCHEMA = ParquetSchema(
    dense=[DenseColumn("clicks_7d", "log1p", 0.0), DenseColumn("price", "none", 0.0), DenseColumn("age", "none", -1.0),
           DenseColumn("dwell_s", "standardize", 0.0)],
    categorical=[CategoricalColumn("item", "integer"), CategoricalColumn("shop", "hex")],
)  # fmt: skip
DWELL_MEAN_STD = [31.25, 12.5]


def flip_middle_bytes(path: Path, count: int = 64) -> None:
    """Inverts ``count`` bytes in the middle of ``path``, its size unchanged (bit rot, not a cut copy)."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + count] = bytes(b ^ 0xFF for b in data[middle : middle + count])
    path.write_bytes(bytes(data))


def test_a_fit_checkpoint_and_its_export_record_the_criteo_layout(checkpoint_writer, tmp_path):
    trained = Path(checkpoint_writer["root"]) / "checkpoints" / "step=16.ckpt"
    assert read_saved_model(trained).data_layout == criteo_layout("tsv", "log1p")
    assert json.loads((trained / "meta.json").read_text())["CriteoDataModule"]["data_layout"]["format"] == "tsv"
    exported = export_checkpoint(str(trained), str(tmp_path / "model.pt"))
    assert read_saved_model(exported).data_layout == criteo_layout("tsv", "log1p")


def test_a_parquet_schema_is_recorded_as_its_columns_and_an_older_checkpoint_reads_as_criteo(tmp_path):
    layout = training_layout("parquet", (tmp_path / "day_0.parquet",), SCHEMA, "log1p")
    assert [c["name"] for c in layout["dense"]] == ["clicks_7d", "price", "age", "dwell_s"]
    assert [(c["name"], c["ids"], c["max_length"]) for c in layout["categorical"]] == [("item", "integer", 0), ("shop", "hex", 0)]
    older = write_model_file(tmp_path / "older.pt", HASHED_SIZES, seed=1)  # no layout recorded
    assert read_saved_model(older).data_layout == criteo_layout()


def test_transform_none_standardize_and_integer_ids_are_lowered_and_the_contract_names_the_columns(tmp_path):
    layout = training_layout("parquet", (), SCHEMA, "log1p")
    path = write_model_file(tmp_path / "schema.pt", HASHED_SIZES, seed=3, data_layout=layout, dense_statistics={"dwell_s": DWELL_MEAN_STD})
    saved = read_saved_weights(path)
    serving = build_serving_module(saved, "none", path)
    generator = torch.Generator().manual_seed(0)
    dense = (torch.randn(50, 4, generator=generator, dtype=torch.float64) * 20).round(decimals=2)  # negatives too
    ids = torch.randint(0, 2**32, (50, 2), generator=generator)
    # As the Parquet reader hands the model: the transforms in float64, the inputs no column fills 0 / id 0.
    features = torch.zeros(50, 13)
    features[:, 0] = torch.log1p(dense[:, 0].clamp_min(0)).float()
    features[:, 1:3] = dense[:, 1:3].float()
    features[:, 3] = ((dense[:, 3] - DWELL_MEAN_STD[0]) / DWELL_MEAN_STD[1]).float()
    rows = torch.zeros(50, 26, dtype=torch.int64)
    rows[:, :2] = torch.remainder(ids, torch.tensor(HASHED_SIZES[:2]))
    model = build_dlrm(**build_dlrm_arguments(saved.hyper_parameters), embedding_device="cpu")
    model.load_state_dict({k.removeprefix("model."): v for k, v in saved.state_dict.items()})
    kjt = KeyedJaggedTensor.from_lengths_sync(list(DEFAULT_CAT_NAMES), rows.T.flatten(), torch.ones(rows.numel(), dtype=torch.int32))
    with torch.no_grad():
        expected = torch.sigmoid(model(features, kjt).squeeze(-1))
        torch.testing.assert_close(serving(dense, ids), expected, rtol=0, atol=1e-6)
    inputs = contract(saved, serving, "none", torch.device("cpu"), 0)["inputs"]
    assert [(i["name"], i["dtype"], i["shape"], i["features"]) for i in inputs] == [
        ("dense_values", "float64", ["batch", 4], ["clicks_7d", "price", "age", "dwell_s"]),
        ("raw_ids", "int64", ["batch", 2], ["item", "shop"])]  # fmt: skip
    assert inputs[0]["transforms"] == ["log1p", "none", "none", "standardize"] and inputs[0]["fills"] == [0.0, 0.0, -1.0, 0.0]
    assert inputs[0]["standardize_mean_std"] == [None, None, None, tuple(DWELL_MEAN_STD)]


def test_a_model_of_the_schemas_features_shared_tables_and_dims_is_lowered(tmp_path):
    schema = ParquetSchema(
        dense=[DenseColumn("price", "none", 0.0), DenseColumn("clicks_7d", "log1p", 0.0)],
        categorical=[CategoricalColumn("item", "integer", table="items", pooling="mean"),
                     CategoricalColumn("shop", "hex", dim=4), CategoricalColumn("last_item", "integer", table="items")],
    )  # fmt: skip
    features = schema.model_features()
    path = write_model_file(tmp_path / "schema.pt", [300, 50, 300], seed=8, data_layout=training_layout("parquet", (), schema, "log1p"),
                            interaction="cat", first_order=False, second_order=False, features=features)  # fmt: skip
    saved = read_saved_weights(path)
    serving = build_serving_module(saved, "none", path)
    generator = torch.Generator().manual_seed(1)
    dense = torch.randn(40, 2, generator=generator, dtype=torch.float64) * 5
    ids = torch.randint(0, 2**32, (40, 3), generator=generator)
    model = build_dlrm(**build_dlrm_arguments(saved.hyper_parameters), embedding_device="cpu")
    model.load_state_dict({k.removeprefix("model."): v for k, v in saved.state_dict.items()})
    rows = torch.remainder(ids, torch.tensor([300, 50, 300]))
    kjt = KeyedJaggedTensor.from_lengths_sync(["item", "shop", "last_item"], rows.T.flatten(), torch.ones(rows.numel(), dtype=torch.int32))
    dense_features = torch.stack([dense[:, 0], torch.log1p(dense[:, 1].clamp_min(0))], dim=1).float()
    with torch.no_grad():
        expected = torch.sigmoid(model(dense_features, kjt).squeeze(-1))
        torch.testing.assert_close(serving(dense, ids), expected, rtol=0, atol=1e-6)
    assert serving.tables.groups == [(False, [1]), (False, [0, 2])]  # by width: shop's 4, then the shared items' 8


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        (training_layout("parquet", (), ParquetSchema(dense=[], categorical=[CategoricalColumn("user", "string"), CategoricalColumn("page", "string")]), "log1p"),
         "feature 'user' has string ids, which the reader hashes (64-bit FNV-1a folded to 32 bits); the package takes integer ids, "
         "so a server would have to hash each string that way before it, and the graph does not hash strings (and 1 more: page)"),
        (training_layout("parquet", (), ParquetSchema(dense=[], categorical=[CategoricalColumn("item", "integer"), CategoricalColumn("history", "integer", 20)]), "log1p"),
         "feature 'history' is a list column (max_length 20); the graph takes one id per feature and row"),
        (criteo_layout("multi_hot", "log1p", "hex", -1), "feature 'C1' comes from multi-hot days (several ids per row)"),
        (criteo_layout("numpy", None, None), "feature 'I1' comes from NumPy days that do not record their dense transform"),
        (training_layout("parquet", (), SCHEMA, "log1p"), "feature 'dwell_s' is standardised, but the checkpoint holds no mean and std for it"),
        (dict(criteo_layout(), dense=[{"name": "price", "transform": "rank_gauss", "fill": 0.0}]),
         "feature 'price' has transform 'rank_gauss'; the graph applies log1p, log_plus_3, none, standardize"),
    ],
    ids=["string_ids", "list_column", "multi_hot", "numpy_unrecorded", "standardize_without_statistics", "unknown_transform"],
)  # fmt: skip
def test_a_feature_the_package_cannot_take_is_refused_before_any_compile(layout, message, tmp_path, capsys):
    path = write_model_file(tmp_path / "model.pt", HASHED_SIZES, seed=4, data_layout=layout)
    with pytest.raises(SystemExit) as stop:
        export_main(["--format", "pt2", "--ckpt_path", str(path), "--output", str(tmp_path / "model.pt2")])
    assert stop.value.code == 2
    error = capsys.readouterr().err.splitlines()[0]
    assert error.startswith(f"error: ckpt_path {path} has no pt2 serving graph: ") and message in error, error
    assert not list(tmp_path.glob("*.pt2*")) and not list(tmp_path.glob(".model.pt2.*"))  # nothing compiled


def test_a_damaged_model_file_is_refused_naming_it(tmp_path, capsys):
    damaged = write_model_file(tmp_path / "model.pt", HASHED_SIZES, seed=2)
    size = damaged.stat().st_size
    flip_middle_bytes(damaged)
    assert damaged.stat().st_size == size
    with pytest.raises(ValueError, match=re.escape(f"{damaged}: damaged (record ")):
        read_saved_model(damaged)
    with pytest.raises(SystemExit):
        export_main(["--format", "pt2", "--ckpt_path", str(damaged), "--output", str(tmp_path / "model.pt2")])
    assert f"error: {damaged}: damaged" in capsys.readouterr().err
