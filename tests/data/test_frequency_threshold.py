"""data.frequency_threshold on the cache path: exact ids for a hand-made file (ids seen >= T times in
the training split -> 2, 3, ...; the rest -> 1), the same mapping at predict time from a checkpoint and
from an exported model (cache gone, another folder), and every refused setting."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from app.checkpoint.export import export_checkpoint
from app.data.datamodule import CriteoDataModule
from app.data.preprocess import RAW_IDS, preprocess
from app.data.tsv import read_tsv
from tests.multiprocess import AGENT_STORE, rendezvous_port, run_folder, start_cli_ranks

THRESHOLD = 2


def tsv_row(label: int, ids: list[str]) -> str:
    """A labelled row with dense fields 1..13 and the given hex ids (missing ones empty)."""
    ids = ids + [""] * (26 - len(ids))
    return "\t".join([str(label)] + [str(i) for i in range(1, 14)] + ids) + "\n"


# C1: 0a x3, 05 x2, ff x1. C2: 10 x4, 20 x1, missing x1. C3: missing x5, 07 x1. C4..C26: missing x6.
TRAIN_IDS = [["0a", "10"], ["0a", "10"], ["05", "20"], ["0a", "10"], ["05", "", "07"], ["ff", "10"]]
# 30 and ee were never seen in training; C2's missing value was seen once (rare), C3's five times.
VAL_IDS = [["0a", "30"], ["05", "10", "07"], ["ee"]]


def write_rows(path: Path, rows: list[list[str]]) -> Path:
    path.write_text("".join(tsv_row(i % 2, ids) for i, ids in enumerate(rows)))
    return path


def module(tmp_path: Path, **settings) -> CriteoDataModule:
    defaults = {"num_embeddings_per_feature": "auto", "frequency_threshold": THRESHOLD, "shuffle": False, "batch_size": 2}
    return CriteoDataModule(cache_dir=str(tmp_path / "cache"), cache_workers=1, **{**defaults, **settings})


def all_ids(data: CriteoDataModule, split: str) -> np.ndarray:
    source = data.datasets[split].source
    return source.take(np.arange(len(source))).sparse


@pytest.fixture
def hand_made(tmp_path) -> dict[str, Path]:
    return {"train": write_rows(tmp_path / "train.tsv", TRAIN_IDS), "val": write_rows(tmp_path / "val.tsv", VAL_IDS)}


def test_ids_seen_at_least_t_times_in_training_get_contiguous_ids_the_rest_one(tmp_path, hand_made, capsys):
    data = module(tmp_path, train=str(hand_made["train"]), val=str(hand_made["val"]))
    assert data.table_sizes is None  # auto: counted in setup, behind the converting ranks' barrier
    data.setup("fit")
    # Vocabularies: C1 {05, 0a}, C2 {10}, C3 {missing = raw 0}, C4..C26 {missing}: sizes + 2.
    assert data.table_sizes == [4, 3, 3] + [3] * 23
    train, val = all_ids(data, "train"), all_ids(data, "val")
    np.testing.assert_array_equal(train[:, 0], [3, 3, 2, 3, 2, 1])  # 05 -> 2, 0a -> 3 (raw-id order), ff -> 1
    np.testing.assert_array_equal(train[:, 1], [2, 2, 1, 2, 1, 2])  # 20 and the one missing value -> 1
    np.testing.assert_array_equal(train[:, 2], [2, 2, 2, 2, 1, 2])  # missing (raw 0, seen 5 times) -> 2
    assert (train[:, 3:] == 2).all()
    np.testing.assert_array_equal(val[:, :3], [[3, 1, 2], [2, 2, 1], [1, 1, 2]])  # unseen 30, ee -> 1
    state = data.state_dict()
    assert state["frequency_threshold"] == THRESHOLD and state["vocabulary"].sizes == [2, 1, 1] + [1] * 23
    # Another threshold reads the same converted days again: only counted and mapped anew.
    capsys.readouterr()
    other = module(tmp_path, train=str(hand_made["train"]), frequency_threshold=3)
    other.setup("fit")
    assert other.table_sizes == [3, 3, 3] + [3] * 23  # C1 {0a}, C2 {10}, C3 {missing}
    assert "preprocessed" not in capsys.readouterr().out
    # A fixed table smaller than its vocabulary + 2 takes the contiguous ids modulo its size, and says so.
    small = module(tmp_path, train=str(hand_made["train"]), num_embeddings_per_feature=3)
    with pytest.warns(UserWarning, match=r"smaller than their vocabulary \+ 2: C1 \(3 rows for 4\);"):
        small.setup("fit")
    np.testing.assert_array_equal(all_ids(small, "train")[:, 0], [0, 0, 2, 0, 2, 1])


def test_only_the_training_rows_of_a_named_split_are_counted(tmp_path):
    # Kaggle's split: 7 days of 2 rows; days 0-5 train, day 6 is test and val. C1's 0b appears only in
    # day 6 (twice): not counted, so it maps to 1 there; 0a (12 times in training) to 2.
    rows = [["0a"]] * 12 + [["0b"], ["0b"]]
    data = module(tmp_path, split="kaggle", root=str(write_rows(tmp_path / "train.txt", rows)), batch_size=1)
    data.setup("validate")
    assert data.table_sizes[0] == 3  # one kept id + 2
    np.testing.assert_array_equal(all_ids(data, "val")[:, 0], [1])
    data.setup("fit")
    assert (all_ids(data, "train")[:, 0] == 2).all()


def test_refused_settings_name_the_setting(tmp_path, hand_made):
    train = str(hand_made["train"])
    with pytest.raises(ValueError, match=r"^data\.frequency_threshold = -1 must be >= 0 \(0 = off\)$"):
        module(tmp_path, train=train, frequency_threshold=-1)
    c2_rare = write_rows(tmp_path / "c2.tsv", [["0a", "10"], ["0a", "10"], ["0a", "20"]])
    # Not refused: every C2 row gets the out-of-vocabulary id 1, with one warning naming the feature.
    with pytest.warns(UserWarning, match=r"^data\.frequency_threshold = 3 leaves C2 with no id: each of its 2 distinct ids "
                                         r"in data\.train is seen fewer than 3 times, so every row gets its out-of-vocabulary id 1") as seen:
        all_rare = module(tmp_path, train=str(c2_rare), frequency_threshold=3)
        all_rare.setup("fit")
    assert sum("leaves" in str(w.message) for w in seen) == 1
    assert all_rare.table_sizes[:2] == [3, 2] and (all_ids(all_rare, "train")[:, 1] == 1).all()
    with pytest.warns(UserWarning, match=r"^--frequency_threshold 3 leaves C2 with no id: .* in the inputs"):
        preprocess(str(c2_rare), str(tmp_path / "c2_days"), workers=1, frequency_threshold=3, progress=False)
    # Preprocessed NumPy days fixed their ids when they were made: the threshold cannot apply there.
    preprocess(train, str(tmp_path / "numpy"), workers=1, progress=False)
    with pytest.raises(ValueError, match=r"data\.train is a folder of NumPy days.*--frequency_threshold 2.*leave "
                                         r"data\.frequency_threshold at 0$"):
        module(tmp_path, train=str(tmp_path / "numpy")).check_inputs("fit")  # the CLI's check before any launch
    with pytest.raises(ValueError, match=r"^data\.frequency_threshold = 2 does not apply to multi-hot days \(data\.train\)"):
        module(tmp_path, train=str(multi_hot_day(tmp_path / "multi_hot")), num_embeddings_per_feature=10).check_inputs("fit")
    # Evaluating needs the training split, where the vocabulary comes from (named before any launch).
    with pytest.raises(ValueError, match=r"^data\.frequency_threshold = 2 maps ids with the vocabulary counted over data\.train: "
                                         r"set data\.train \(or data\.split\) for this stage too, or give --ckpt_path$"):
        module(tmp_path, val=str(hand_made["val"]), num_embeddings_per_feature=10).check_inputs("validate")
    # Predict maps with a checkpoint's vocabulary: without one, it is refused rather than guessed.
    data = module(tmp_path, predict=str(hand_made["val"]), num_embeddings_per_feature=10)
    data.setup("predict")
    with pytest.raises(ValueError, match=r"predict maps ids with the vocabulary saved in the checkpoint.*give --ckpt_path"):
        data.predict_dataloader()


def multi_hot_day(folder: Path, rows: int = 4) -> Path:
    """One day of MLPerf's multi-hot layout (2 ids per bag)."""
    folder.mkdir(parents=True)
    np.savez(folder / "day_0_sparse_multi_hot.npz", **{str(j): np.zeros((rows, 2), np.int32) for j in range(26)})
    np.save(folder / "day_0_dense.npy", np.zeros((rows, 13), np.float32))
    np.save(folder / "day_0_labels.npy", np.zeros((rows, 1), np.int32))
    return folder


# ---- through the CLI: fit on 2 processes, then predict from the checkpoint and from an export ------


def cli_args(subcommand: str, root: Path, data: dict[str, Path], *extra: str) -> list[str]:
    return [
        subcommand,
        "--config", "configs/demo.yaml",
        "--data.train", str(data["train"]),
        "--data.val", str(data["val"]),
        "--data.test", "null",
        "--data.predict", str(data["val"]),  # scores the validation rows: ids unseen in training included
        "--data.batch_size", "64",
        "--data.num_embeddings_per_feature", "auto",
        "--data.frequency_threshold", str(THRESHOLD),
        "--data.cache_dir", str(data["cache"]),
        "--data.cache_workers", "1",
        "--model.embedding_dim", "8",
        "--model.dense_arch_layer_sizes", "[16, 8]",
        "--model.over_arch_layer_sizes", "[16, 1]",
        "--trainer.max_epochs", "1",
        "--trainer.logger", "false",
        "--trainer.enable_progress_bar", "false",
        "--trainer.default_root_dir", str(root),
        *extra,
    ]  # fmt: skip


def run_ranks(world_size: int, args: list[str], folder: Path, inspect=None) -> list[dict]:
    """``python -m app <args>`` on new processes (tests/multiprocess.py); each rank's result or error."""
    out = run_folder(folder, "ranks")
    with rendezvous_port() as port:
        start_cli_ranks(world_size, port, args, inspect, out)
    return [pickle.loads((out / f"rank{rank}.pkl").read_bytes()) for rank in range(world_size)]


def one_process_runs(_: int, runs: list[list[str]], inspect, out: str, environment: dict[str, str]) -> None:
    """Several single-process ``python -m app`` runs, one after the other in one process forked from the
    fork server (what tests/multiprocess.py's worker does for one run), each on a fresh process group;
    ``environment``: the test's, as that worker takes it."""
    os.environ.clear()
    os.environ.update(environment)
    results = []
    for args in runs:
        with rendezvous_port() as port:  # a store of its own per run, hosted here
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK="0", NODE_RANK="0",
                              APP_TRACEBACK="1", **AGENT_STORE)  # fmt: skip
            try:
                from app.cli import cli_main

                results.append(inspect(cli_main(args + ["--trainer.devices", "1"])))
            except BaseException as error:  # reported to the test
                results.append({"error": f"{type(error).__name__}: {error}\n{traceback.format_exc()}"})
            finally:
                if dist.is_initialized():
                    dist.destroy_process_group()
    Path(out, "runs.pkl").write_bytes(pickle.dumps(results))


def run_one_after_another(runs: list[list[str]], folder: Path, inspect) -> list[dict]:
    out = run_folder(folder, "runs")
    mp.start_processes(one_process_runs, args=(runs, inspect, str(out), dict(os.environ)), nprocs=1, start_method="forkserver")
    return pickle.loads((out / "runs.pkl").read_bytes())


def predicted_ids(cli) -> dict:
    """The ids predict fed the model, and the table sizes it was built with."""
    return {"ids": cli.datamodule.datasets["predict"].source.sparse.copy(), "table_sizes": cli.datamodule.table_sizes}


def expected_ids(train: Path, scored: Path) -> tuple[np.ndarray, list[int]]:
    """Independently of the app's counting: per feature, the raw ids seen >= T times in training,
    sorted; a scored id's position + 2, or 1. With the table sizes auto gives (kept ids + 2)."""
    raw_train, raw_scored = read_tsv(train, RAW_IDS).sparse, read_tsv(scored, RAW_IDS).sparse
    expected, sizes = np.ones_like(raw_scored), []
    for j in range(26):
        ids, counts = np.unique(raw_train[:, j], return_counts=True)
        kept = ids[counts >= THRESHOLD]
        sizes.append(kept.size + 2)
        for row, raw in enumerate(raw_scored[:, j]):
            if raw in kept:
                expected[row, j] = int(np.flatnonzero(kept == raw)[0]) + 2
    return expected, sizes


@pytest.fixture(scope="module")
def trained(sample, tmp_path_factory) -> dict:
    """A 2-process fit of one epoch with the threshold; its last checkpoint."""
    folder = tmp_path_factory.mktemp("threshold_fit")
    data = {**sample, "cache": folder / "cache"}
    (rank0, _) = run_ranks(2, cli_args("fit", folder / "run", data), folder, table_sizes)
    assert "error" not in rank0, rank0["error"]
    return {"data": data, "checkpoint": folder / "run" / "checkpoints" / "last.ckpt", "table_sizes": rank0["table_sizes"]}


def table_sizes(cli) -> dict:
    return {"table_sizes": cli.model.hparams["num_embeddings_per_feature"]}


def test_predict_maps_ids_as_training_did_from_a_checkpoint_and_an_export_and_refuses_another_threshold(trained, tmp_path):
    data, checkpoint = trained["data"], trained["checkpoint"]
    # The checkpoint folder holds the vocabulary; meta.json the threshold and the vocabulary's name.
    meta = json.loads((checkpoint / "meta.json").read_text())
    saved = meta["CriteoDataModule"]
    assert saved["frequency_threshold"] == THRESHOLD and saved["vocabulary"]["saved_in"] == "vocabulary"
    assert len(list((checkpoint / "vocabulary").glob("vocab_feature_*.npy"))) == 26
    expected, sizes = expected_ids(data["train"], data["val"])
    assert (expected == 1).any() and (expected > 2).any()  # rare and kept ids both scored
    assert trained["table_sizes"] == sizes  # auto: the vocabulary sizes + 2

    # An export in another folder, scored with the cache gone and no training data in the settings.
    exported = export_checkpoint(str(checkpoint), str(tmp_path / "elsewhere" / "model.pt"))
    shutil.rmtree(data["cache"])
    # The sizes stay `auto` and the threshold unset: both are the checkpoint's (it carries its model).
    no_training_data = ["--data.train", "null", "--data.val", "null", "--data.frequency_threshold", "0"]
    runs = [
        cli_args("predict", tmp_path / "ckpt", data, "--ckpt_path", str(checkpoint), *no_training_data,
                 "--prediction_writer.output_dir", str(tmp_path / "ckpt")),  # not the checkpoint's run folder
        cli_args("predict", tmp_path / "export", data, "--ckpt_path", str(exported), *no_training_data),
        # Another threshold given: its ids would mean other things than the model's.
        cli_args("predict", tmp_path / "refused", data, "--ckpt_path", str(checkpoint), *no_training_data,
                 "--data.frequency_threshold", "3"),
    ]  # fmt: skip
    from_checkpoint, from_export, refused = run_one_after_another(runs, tmp_path, predicted_ids)
    for result in (from_checkpoint, from_export):
        assert "error" not in result, result["error"]
        np.testing.assert_array_equal(result["ids"], expected)
        assert result["table_sizes"] == sizes  # the checkpoint's, with data.num_embeddings_per_feature: auto
    assert not data["cache"].exists()  # nothing was converted or counted again
    scores = [(tmp_path / run / "predictions.tsv").read_text() for run in ("ckpt", "export")]
    assert scores[0] == scores[1] and len(scores[0].splitlines()) == 301
    message = (f"ValueError: data.frequency_threshold = 3 here, but ckpt_path {checkpoint} holds a model with "
               "data.frequency_threshold = 2")  # fmt: skip
    assert message in refused.get("error", ""), refused
    assert not (tmp_path / "refused" / "predictions.tsv").exists()
