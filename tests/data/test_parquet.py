"""Parquet input: the converter, the cache's days from Parquet equal to raw TSV's (so every batch
after the vocabulary's mapping is the same), string and integer ids, and every bad input refused with
the file, the column and the row group."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from app.criteo import DENSE_NAMES, SPARSE_NAMES
from app.data.datamodule import CriteoDataModule
from app.data.parquet.reader import iter_parquet_chunks, string_hashes
from app.data.parquet.schema import CategoricalColumn, DenseColumn, ParquetSchema
from app.data.synthetic import write_synthetic_criteo
from app.data.to_parquet import main as to_parquet_main


@pytest.fixture(scope="module")
def roads(tmp_path_factory) -> dict[str, Path]:
    """A synthetic Criteo split as raw TSV and, converted by the command, as Parquet (small row groups)."""
    folder = tmp_path_factory.mktemp("roads")
    write_synthetic_criteo(folder / "train.tsv", num_rows=3_000, seed=3)
    write_synthetic_criteo(folder / "val.tsv", num_rows=500, seed=4)
    assert to_parquet_main(["--input", f"[{folder / 'train.tsv'}, {folder / 'val.tsv'}]", "--output", str(folder / "pq"),
                            "--row_group_rows", "1000"]) == 0  # fmt: skip
    return {"folder": folder, "train.tsv": folder / "train.tsv", "val.tsv": folder / "val.tsv",
            "train.parquet": folder / "pq" / "train.parquet", "val.parquet": folder / "pq" / "val.parquet"}  # fmt: skip


def batches(data: CriteoDataModule, split: str) -> list:
    loader = data.train_dataloader() if split == "train" else data.val_dataloader()
    return list(loader)


def test_the_parquet_road_gives_the_tsv_roads_batches_after_the_vocabulary(roads):
    modules = {}
    for road in ("tsv", "parquet"):
        modules[road] = CriteoDataModule(
            train=str(roads[f"train.{road}"]), val=str(roads[f"val.{road}"]), batch_size=128, frequency_threshold=2,
            num_embeddings_per_feature="auto", cache_dir=str(roads["folder"] / f"cache_{road}"), cache_workers=1, seed=5,
        )  # fmt: skip
        modules[road].setup("fit")
    assert modules["tsv"].table_sizes == modules["parquet"].table_sizes
    for split in ("train", "val"):
        tsv, parquet = batches(modules["tsv"], split), batches(modules["parquet"], split)
        assert len(tsv) == len(parquet) > 1
        for a, b in zip(tsv, parquet):
            assert a.dense_features.equal(b.dense_features) and a.labels.equal(b.labels)
            assert a.sparse_features.values().equal(b.sparse_features.values())
            assert a.sparse_features.lengths().equal(b.sparse_features.lengths())


def test_the_converter_writes_named_columns_with_string_ids_and_nulls_for_empty_fields(roads):
    table = pq.read_table(roads["train.parquet"])
    assert table.column_names == ["label", *DENSE_NAMES, *SPARSE_NAMES]
    assert pq.ParquetFile(roads["train.parquet"]).metadata.num_row_groups == 3
    first = roads["train.tsv"].read_text().splitlines()[0].split("\t")
    row = table.slice(0, 1).to_pylist()[0]
    assert row["label"] == int(first[0])
    assert [row[n] for n in DENSE_NAMES] == [int(f) if f else None for f in first[1:14]]
    assert [row[n] for n in SPARSE_NAMES] == [f or None for f in (first[14:] + [""] * 26)[:26]]


def test_string_ids_hash_equal_strings_equally_and_nulls_to_id_zero(tmp_path):
    words = ["user-1", "user-2", "user-1", None, "élan", ""]
    hashes = string_hashes(pa.array(["user-1", "user-2", "élan", ""], pa.large_string()))
    assert len(set(hashes.tolist())) == 4
    # FNV-1a 64 of b"" is its offset basis; folded to 32 bits by xor of the halves.
    assert hashes[3] == (0xCBF29CE484222325 ^ (0xCBF29CE484222325 >> 32)) & 0xFFFFFFFF
    # Fewer columns than the model's inputs: the others hold dense 0 and id 0.
    schema = ParquetSchema(dense=[DenseColumn("price", "none", 0.0)],
                           categorical=[CategoricalColumn("user", "string"), CategoricalColumn("item", "integer")])  # fmt: skip
    columns = {"label": [0, 1, 1, 0, 1, 0], "user": words, "item": [7, 8, 9, 7, None, 2**32 - 1], "price": [2.5, None] * 3}
    pq.write_table(pa.table(columns), tmp_path / "own.parquet")
    (arrays, _), = list(iter_parquet_chunks(tmp_path / "own.parquet", schema, 1 << 20))
    assert arrays.sparse[:, 0].tolist() == [hashes[0], hashes[1], hashes[0], 0, hashes[2], hashes[3]]
    assert arrays.sparse[:, 1].tolist() == [7, 8, 9, 7, 0, 2**32 - 1] and (arrays.sparse[:, 2:] == 0).all()
    assert arrays.dense[:, 0].tolist() == [2.5, 0.0] * 3 and (arrays.dense[:, 1:] == 0).all()
    assert arrays.labels.tolist() == [0, 1, 1, 0, 1, 0]


def criteo_columns(rows: int = 4) -> dict[str, list]:
    return {"label": [0, 1] * (rows // 2)} | {n: [1] * rows for n in DENSE_NAMES} | {n: ["0a"] * rows for n in SPARSE_NAMES}


def refused(tmp_path: Path, columns: dict, schema: ParquetSchema | None = None, row_group_size: int = 2) -> str:
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)
    with pytest.raises(ValueError) as error:
        list(iter_parquet_chunks(path, schema or ParquetSchema(), 1 << 20))
    assert str(path) in str(error.value)
    return str(error.value)


def test_bad_parquet_inputs_are_refused_naming_the_file_column_and_row_group(tmp_path):
    missing = criteo_columns()
    del missing["C7"]
    assert "column 'C7' of data.schema is missing" in refused(tmp_path, missing)
    assert "column 'I3' holds string; data.schema declares numbers" in refused(tmp_path, criteo_columns() | {"I3": ["1"] * 4})
    assert "column 'C2' holds list<element: string>; data.schema declares strings" in refused(tmp_path, criteo_columns() | {"C2": [["0a"]] * 4})
    integer_ids = replace(ParquetSchema(), categorical=[CategoricalColumn(n, "integer") for n in SPARSE_NAMES])
    assert "column 'C1' holds string; data.schema declares integers" in refused(tmp_path, criteo_columns(), integer_ids)
    negative = criteo_columns() | {n: [5] * 4 for n in SPARSE_NAMES} | {"C4": [1, 2, 3, -1]}
    assert "row group 1: column 'C4' holds 1 ids outside 0 .. 2**32 - 1 (the first: -1)" in refused(tmp_path, negative, integer_ids)
    assert "row group 1: label column 'label' has 1 null values" in refused(tmp_path, criteo_columns() | {"label": [0, 1, None, 1]})
    assert "row group 0: label column 'label' holds 1 values other than 0 and 1 (the first: 2 at row 1" in refused(
        tmp_path, criteo_columns() | {"label": [0, 2, 1, 1]})
    no_fill = replace(ParquetSchema(), dense=[DenseColumn(n) for n in DENSE_NAMES])
    message = refused(tmp_path, criteo_columns() | {"I5": [1, None, None, 1]}, no_fill)
    assert "row group 0: dense column 'I5' has 1 null values; set its fill" in message
    assert "column 'C9' holds 'xyz', not 1 to 8 hexadecimal digits" in refused(tmp_path, criteo_columns() | {"C9": ["xyz"] * 4})
    assert "the Parquet file holds no rows (row groups: 1)" in refused(tmp_path, {k: pa.array([], pa.int64()) for k in ["label", *DENSE_NAMES]}
                                                        | {n: pa.array([], pa.string()) for n in SPARSE_NAMES})  # fmt: skip
    # Files whose schemas disagree: the first that differs from data.schema is named.
    pq.write_table(pa.table(criteo_columns() | {"C2": [3] * 4}), tmp_path / "part-2.parquet")
    with pytest.raises(ValueError, match=r"part-2.parquet: column 'C2' holds int64; data.schema declares strings"):
        list(iter_parquet_chunks(tmp_path / "part-2.parquet", ParquetSchema(), 1 << 20))
    (tmp_path / "text.parquet").write_text("not parquet")
    with pytest.raises(ValueError, match="text.parquet: not a readable Parquet file"):
        list(iter_parquet_chunks(tmp_path / "text.parquet", ParquetSchema(), 1 << 20))


def test_a_schema_of_another_shape_or_repeating_a_column_is_refused():
    with pytest.raises(ValueError, match="data.schema.dense has 14 columns; the model takes at most 13"):
        ParquetSchema(dense=[DenseColumn(f"d{i}") for i in range(14)])
    with pytest.raises(ValueError, match="data.schema.categorical has 0 columns; the model takes 1 to 26"):
        ParquetSchema(categorical=[])
    with pytest.raises(ValueError, match="names column 'I1' more than once"):
        ParquetSchema(label="I1")


def test_key_columns_are_checked_in_the_predict_files_and_read_as_text(tmp_path):
    from app.data.parquet.keys import check_key_columns, read_key_columns

    path = tmp_path / "predict.parquet"
    pq.write_table(pa.table({"request": ["r1", None, "r3"], "item": [10, 11, 12], "tags": [["a"], [], ["b"]]}), path)
    assert read_key_columns([path, path], ["request", "item"]) == {"request": ["r1", "", "r3"] * 2, "item": ["10", "11", "12"] * 2}
    with pytest.raises(ValueError, match=r"predict.parquet: key column 'user' of data.schema.key_columns is missing"):
        check_key_columns([path], ["request", "user"])
    with pytest.raises(ValueError, match=r"key column 'tags' holds list<element: string>; key columns hold one value a row"):
        check_key_columns([path], ["tags"])
    pq.write_table(pa.table({"request": ["a\tb"]}), path)
    with pytest.raises(ValueError, match=r"key column 'request' holds 'a\\tb': a tab or line break"):
        read_key_columns([path], ["request"])


def test_a_failed_conversion_leaves_no_valid_cache_and_a_missing_group_column_is_named(tmp_path):
    import json

    path = tmp_path / "train.parquet"
    pq.write_table(pa.table(criteo_columns(6) | {"label": [0, 1, 0, 1, 7, 0]}), path, row_group_size=2)
    data = CriteoDataModule(train=str(path), cache_dir=str(tmp_path / "cache"), cache_workers=1, batch_size=2)
    with pytest.raises(ValueError, match=r"train.parquet: row group 2: label column 'label' holds 1 values other than 0 and 1"):
        data.setup("fit")
    (folder,) = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    state = json.loads((folder / "cache.json").read_text())
    assert state["complete"] is False and "row group 2" in state["error"]
    assert not list(folder.glob("day_0_*.npy"))  # the day's files stay under their partial names, removed
    grouped = CriteoDataModule(train=str(path), cache_dir=str(tmp_path / "cache"), cache_workers=1, batch_size=2,
                               schema=replace(ParquetSchema(), group="user"))  # fmt: skip
    with pytest.raises(ValueError, match=r"train.parquet: column 'user' of data.schema is missing"):
        grouped.setup("fit")


def test_the_schema_and_its_fields_are_documented_in_the_command_line_help(capsys):
    from app.cli import cli_main

    try:
        cli_main(["fit", "--data.schema.help", "ParquetSchema"])
    except SystemExit as exit_info:  # jsonargparse's help exits (with 0)
        assert not exit_info.code
    shown = " ".join(capsys.readouterr().out.split())
    for text in ("--data.schema.label", "the label column: 0/1", "--data.schema.group", "GAUC", "--data.schema.key_columns",
                 "up to 13 numeric columns", "1 to 26 id columns"):  # fmt: skip
        assert text in shown, text


def _trained(cli) -> dict:
    """The validation metrics and the dense layers' weights after fit (the tables enter the metrics)."""
    module = cli.trainer.lightning_module
    dense = {name: p.detach().numpy().copy() for name, p in module.named_parameters() if "embedding_bags" not in name}
    return {"metrics": {k: float(v) for k, v in cli.trainer.callback_metrics.items()}, "dense": dense,
            "step": cli.trainer.global_step}  # fmt: skip


def test_the_two_roads_train_the_same_model_on_2_processes(roads, tmp_path):
    from tests.multiprocess import DEMO_BEFORE_QUALITY_SETTINGS, run_on_ranks

    results = {}
    for road in ("tsv", "parquet"):
        args = [
            "fit", "--config", "configs/demo.yaml", *DEMO_BEFORE_QUALITY_SETTINGS, "--data.train", str(roads[f"train.{road}"]),
            "--data.val", str(roads[f"val.{road}"]), "--data.test", "null", "--data.predict", "null",
            "--data.batch_size", "128", "--data.frequency_threshold", "2", "--data.num_embeddings_per_feature", "auto",
            "--data.cache_dir", str(tmp_path / f"cache_{road}"), "--model.embedding_dim", "8",
            "--model.dense_arch_layer_sizes", "[16, 8]", "--model.over_arch_layer_sizes", "[16, 1]",
            "--trainer.max_epochs", "1", "--trainer.logger", "false", "--trainer.enable_checkpointing", "false",
            "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(tmp_path / road),
        ]  # fmt: skip
        results[road] = run_on_ranks(2, args, tmp_path / road, _trained)[0]
    tsv, parquet = results["tsv"], results["parquet"]
    assert tsv["step"] == parquet["step"] == 12  # 3,000 rows in global batches of 256: 11 full, one of 184
    same = {name for name in tsv["metrics"] if name != "train/samples_per_sec"}  # a wall-clock rate
    assert {"val/auc", "val/logloss", "train/loss"} <= same
    assert {name: tsv["metrics"][name] for name in same} == {name: parquet["metrics"][name] for name in same}
    assert tsv["dense"].keys() == parquet["dense"].keys()
    assert all(np.array_equal(tsv["dense"][name], parquet["dense"][name]) for name in tsv["dense"])


def test_a_list_column_reaches_the_model_as_a_jagged_feature_summed_per_row(tmp_path):
    from app.model.dlrm import build_embedding_bag_collection

    lists = [[5, 1005, 7, 9], None, [], [3], [2, 2]]  # 4 ids cut to 3; a null and an empty list: no id
    columns = {"label": [0, 1, 0, 1, 1], "price": [1.0, 2.0, None, 4.0, 5.0], "user": ["a", "b", "a", "c", "b"],
               "recent_items": pa.array(lists, pa.list_(pa.int64()))}  # fmt: skip
    pq.write_table(pa.table(columns), tmp_path / "train.parquet", row_group_size=2)
    schema = ParquetSchema(label="label", dense=[DenseColumn("price", "none", 0.0)],
                           categorical=[CategoricalColumn("user"), CategoricalColumn("recent_items", "integer", max_length=3)])  # fmt: skip
    data = CriteoDataModule(train=str(tmp_path / "train.parquet"), schema=schema, num_embeddings_per_feature=1000,
                            batch_size=5, shuffle=False, cache_dir=str(tmp_path / "cache"), cache_workers=1)  # fmt: skip
    with pytest.warns(UserWarning, match=r"train.parquet: 1 lists longer than their data.schema max_length were cut"):
        data.setup("fit")
    (batch,) = list(data.train_dataloader())
    items = batch.sparse_features["recent_items"]
    assert items.lengths().tolist() == [3, 0, 0, 1, 2]  # each row's true length, not padded
    assert items.values().tolist() == [5, 5, 7, 3, 2, 2]  # ids modulo the table's 1,000 rows; 9 was cut
    assert batch.sparse_features["user"].lengths().tolist() == [1] * 5
    assert batch.sparse_features.keys() == ["user", "recent_items"]  # the schema's features, no constant input
    tables = build_embedding_bag_collection(4, [1000] * 2, device="cpu", features=data.model_features)
    pooled = tables(batch.sparse_features).to_dict()["recent_items"]
    weight = tables.embedding_bags["t_recent_items"].weight.detach()
    by_hand = torch.stack([weight[ids].sum(0) if ids else torch.zeros(4) for ids in ([5, 5, 7], [], [], [3], [2, 2])])
    assert torch.allclose(pooled, by_hand, atol=1e-6)
    with pytest.raises(ValueError, match=r"data.frequency_threshold = 3 does not apply to the list columns of data.schema \(recent_items\)"):
        CriteoDataModule(train=str(tmp_path / "train.parquet"), schema=schema, frequency_threshold=3).check_inputs("fit")
    # auto: the distinct ids seen, those of the lists included (5, 1005, 7, 3, 2; 9 was cut), and the
    # 0 that the feature's single-id column holds: a table of 6 rows.
    sized = CriteoDataModule(train=str(tmp_path / "train.parquet"), schema=schema, num_embeddings_per_feature="auto",
                             cache_dir=str(tmp_path / "cache"), cache_workers=1, batch_size=5)  # fmt: skip
    sized.setup("fit")
    assert sized.table_sizes[:2] == [3, 6]
