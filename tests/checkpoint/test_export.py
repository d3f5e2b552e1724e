"""`python -m app export` writes one plain model file; `predict` scores from it as from the sharded checkpoint."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from app.checkpoint.export import export_checkpoint, load_exported_into, main
from app.cli import cli_main
from app.train.module import DLRMModule
from tests.multiprocess import run_on_ranks
from tests.reshard_runs import eval_args, plan_args
from tests.distributed.test_sharding import EMBEDDING_DIM, NUM_TABLES, TABLE_SIZE, shards_and_predictions


@pytest.fixture(scope="module")
def exported(checkpoint_writer, tmp_path_factory):
    return export_checkpoint(str(checkpoint_writer["root"] / "checkpoints" / "step=16.ckpt"), str(tmp_path_factory.mktemp("export") / "model.pt"))


def test_the_exported_file_is_plain_tensors_and_hyper_parameters(exported):
    content = torch.load(exported, weights_only=True)  # no pickled code, no TorchRec types
    assert content["format"] == "app.export/1"
    assert content["hyper_parameters"]["embedding_dim"] == EMBEDDING_DIM
    tables = {k: v for k, v in content["state_dict"].items() if ".embedding_bags." in k}
    assert len(tables) == NUM_TABLES
    assert {tuple(v.shape) for v in tables.values()} == {(TABLE_SIZE, EMBEDDING_DIM)}  # whole, not shards
    assert all(type(v) is torch.Tensor for v in content["state_dict"].values())


def test_predict_from_the_exported_file_equals_the_sharded_checkpoint(exported, checkpoint_writer, sample, tmp_path):
    # The file carries its model (docs/checkpoints.md): the settings of eval_args build it.
    args = eval_args(sample, tmp_path, "predict", 1, exported, plan_args("table_wise", {}))
    (result,) = run_on_ranks(1, args, tmp_path, shards_and_predictions)
    np.testing.assert_allclose(result["probabilities"], checkpoint_writer["result"]["probabilities"], rtol=0, atol=1e-6)
    lines = (tmp_path / "predictions.tsv").read_text().splitlines()  # under trainer.default_root_dir
    assert lines[0] == "row_id\tprobability"
    assert [int(line.split("\t")[0]) for line in lines[1:]] == list(range(300))  # one line per row, in order
    written = np.array([float(line.split("\t")[1]) for line in lines[1:]])
    # 1e-6 from the model, up to 5e-7 more from the file's 6 decimals
    np.testing.assert_allclose(written, checkpoint_writer["result"]["probabilities"], rtol=0, atol=1.5e-6)


def test_a_setting_that_contradicts_the_exported_model_is_refused_naming_both_values(exported, sample, tmp_path, capfd):
    other_model = ["--model.dense_arch_layer_sizes", "[32, 8]"]  # another network than the file's [16, 8]
    args = eval_args(sample, tmp_path, "predict", 1, exported, plan_args("table_wise", {})) + other_model
    with pytest.raises(SystemExit) as stop:
        cli_main(args + ["--trainer.devices", "1"])
    assert stop.value.code == 2
    assert (f"error: model.dense_arch_layer_sizes = [32, 8] here, but ckpt_path {exported} holds a model with "
            "model.dense_arch_layer_sizes = [16, 8]") in capfd.readouterr().err  # fmt: skip
    assert not (tmp_path / "predictions.tsv").exists()


def test_export_names_a_missing_path_and_a_folder_that_is_not_a_checkpoint(tmp_path, capsys):
    for path, message in ((tmp_path / "nowhere", "no such checkpoint"), (tmp_path, "not a complete checkpoint of this app")):
        with pytest.raises(SystemExit) as stop:
            main(["--ckpt_path", str(path), "--output", str(tmp_path / "model.pt")])
        assert stop.value.code == 2
        assert f"error: ckpt_path {path}: {message}" in capsys.readouterr().err
    assert not (tmp_path / "model.pt").exists()


def test_loading_a_file_that_is_not_an_export_or_of_another_model_is_refused(exported, tmp_path):
    not_a_model = tmp_path / "notes.txt"
    not_a_model.write_text("hello")
    with pytest.raises(ValueError, match="is neither a sharded checkpoint folder nor a model file"):
        load_exported_into(not_a_model, torch.nn.Linear(1, 1))
    other = DLRMModule(embedding_dim=EMBEDDING_DIM, num_embeddings_per_feature=TABLE_SIZE + 1,
                       dense_arch_layer_sizes=[16, EMBEDDING_DIM], over_arch_layer_sizes=[16, 1])  # fmt: skip
    with pytest.raises(ValueError, match=r"t_cat_0.weight has shape \(500, 8\); this model's is \(501, 8\)"):
        load_exported_into(exported, other)
