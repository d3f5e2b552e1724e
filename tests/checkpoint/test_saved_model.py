"""A checkpoint carries its model: validate, predict (1 and 3 processes) and export of a 2-process
checkpoint give the same metrics and probabilities whatever training data the command names, read
none of it, and refuse a setting that contradicts the checkpoint, naming both values."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from app.checkpoint.export import export_checkpoint
from app.cli import cli_main
from app.data.synthetic import write_synthetic_criteo
from tests.multiprocess import run_on_ranks

THRESHOLD = 2


def demo_args(subcommand: str, root: Path, train: Path, val: Path, cache: Path, *extra: str) -> list[str]:
    """The demo's recipe (auto table sizes, a frequency threshold) on a small model and the test's rows."""
    return [
        subcommand, "--config", "configs/demo.yaml",
        "--data.train", str(train), "--data.val", str(val), "--data.test", "null", "--data.predict", str(val),
        "--data.batch_size", "64", "--data.frequency_threshold", str(THRESHOLD), "--data.cache_dir", str(cache),
        "--data.cache_workers", "1",
        "--model.embedding_dim", "8", "--model.dense_arch_layer_sizes", "[16, 8]", "--model.over_arch_layer_sizes", "[16, 1]",
        "--trainer.precision", "32-true", "--trainer.max_epochs", "1", "--trainer.logger", "false",
        "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(root), *extra,
    ]  # fmt: skip


def metrics(cli) -> dict:
    """The metrics of the run, and the table sizes its model was built with."""
    values = {name: float(value) for name, value in cli.trainer.callback_metrics.items()}
    return {"metrics": values, "table_sizes": list(cli.model.hparams["num_embeddings_per_feature"])}


def probabilities(root: Path) -> np.ndarray:
    lines = (root / "predictions.tsv").read_text().splitlines()[1:]
    return np.array([float(line.split("\t")[1]) for line in lines])


@pytest.fixture(scope="module")
def trained(sample, tmp_path_factory) -> dict:
    """A 2-process fit of the demo's recipe; rows of another source to name as data.train afterwards."""
    folder = tmp_path_factory.mktemp("saved_model")
    other_train = folder / "other_train.tsv"
    write_synthetic_criteo(other_train, num_rows=512, seed=77)  # other ids, other sizes
    cache = folder / "cache"
    (rank0, _) = run_on_ranks(2, demo_args("fit", folder / "run", sample["train"], sample["val"], cache), folder, metrics)
    return {"checkpoint": folder / "run" / "checkpoints" / "last.ckpt", "other_train": other_train, "cache": cache,
            "table_sizes": rank0["table_sizes"]}  # fmt: skip


def test_validate_takes_the_checkpoints_model_whatever_data_train_names(trained, sample, tmp_path):
    checkpoint, cache = str(trained["checkpoint"]), trained["cache"]
    named = demo_args("validate", tmp_path / "a", sample["train"], sample["val"], cache, "--ckpt_path", checkpoint)
    other = demo_args("validate", tmp_path / "b", trained["other_train"], sample["val"], cache, "--ckpt_path", checkpoint)
    with_training_data = run_on_ranks(2, named, tmp_path, metrics)[0]
    with_other_data = run_on_ranks(2, other, tmp_path, metrics)[0]
    on_three = run_on_ranks(3, other, tmp_path, metrics)[0]
    assert with_other_data == with_training_data  # bit for bit: the same model, the same rows
    assert with_training_data["table_sizes"] == trained["table_sizes"]
    assert with_training_data["metrics"]["val/auc"] > 0.5
    for name, value in with_training_data["metrics"].items():  # 3 ranks sum the same rows in another order
        assert on_three["metrics"][name] == pytest.approx(value, rel=1e-6, abs=1e-8), name
    # Neither the other rows nor a vocabulary of them was cached: nothing of data.train was read.
    assert not [path.name for path in cache.iterdir() if path.name.startswith("other_train")]


def test_predict_and_export_take_the_checkpoints_model_on_one_and_three_processes(trained, sample, tmp_path):
    checkpoint, cache = str(trained["checkpoint"]), trained["cache"]
    # Each into its own folder (by default predict writes into the checkpoint's run folder).
    named = ["--ckpt_path", checkpoint, "--prediction_writer.output_dir", str(tmp_path / "named")]
    run_on_ranks(2, demo_args("predict", tmp_path / "named", sample["train"], sample["val"], cache, *named), tmp_path)
    expected = probabilities(tmp_path / "named")
    assert expected.size == 300 and expected.std() > 0
    exported = export_checkpoint(checkpoint, str(tmp_path / "model.pt"))
    for world_size, source in ((1, checkpoint), (3, checkpoint), (1, str(exported)), (3, str(exported))):
        root = tmp_path / f"other_{world_size}_{Path(source).suffix.strip('.')}"
        scored = ["--ckpt_path", source, "--prediction_writer.output_dir", str(root)]
        run_on_ranks(world_size, demo_args("predict", root, trained["other_train"], sample["val"], cache, *scored), tmp_path)
        # Tables sharded otherwise on 1 and 3 processes: the same rows, summed in another order.
        np.testing.assert_allclose(probabilities(root), expected, rtol=0, atol=1e-6, err_msg=f"{world_size} processes, {source}")


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        (["--model.embedding_dim", "16", "--model.dense_arch_layer_sizes", "[16, 16]"],
         "model.dense_arch_layer_sizes = [16, 16] here, but ckpt_path {path} holds a model with model.dense_arch_layer_sizes = [16, 8]"),
        (["--model.interaction", "dcn"], "model.interaction = 'dcn' here, but ckpt_path {path} holds a model with model.interaction = 'dot'"),
        (["--data.num_embeddings_per_feature", "1000"],
         "data.num_embeddings_per_feature = 1000 here, but ckpt_path {path} holds a model with data.num_embeddings_per_feature = ["),
        (["--data.frequency_threshold", "5"],
         "data.frequency_threshold = 5 here, but ckpt_path {path} holds a model with data.frequency_threshold = 2"),
    ],
    ids=["dense_arch", "interaction", "table_sizes", "threshold"],
)  # fmt: skip
def test_a_setting_that_contradicts_the_checkpoint_is_refused_before_any_launch(trained, sample, tmp_path, capfd, setting, message):
    path = trained["checkpoint"]
    args = demo_args("validate", tmp_path, sample["train"], sample["val"], trained["cache"], "--ckpt_path", str(path), *setting)
    with pytest.raises(SystemExit) as stop:
        cli_main(args + ["--trainer.devices", "2"])
    assert stop.value.code == 2
    assert f"error: {message.format(path=path)}" in capfd.readouterr().err
