"""The one road from raw TSV to batches: the NumPy cache made by the data module's ``setup``, its reuse and
redoing, table sizes from the data, and what each stage reads."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from app.data.batches import make_batch
from app.data.cache import CACHE_FILE, CacheRequest, cached_days
from app.data.datamodule import CriteoDataModule
from app.data.synthetic import write_synthetic_criteo
from app.data.tsv import CriteoFormatError, read_tsv
from tests.child_process import read_until
from tests.multiprocess import run_on_ranks

SIZES = [3, 7, 10, 97, 100, 1_000, 4_096, 10_000, 65_537, 10**6] * 2 + [2, 5, 11, 13, 40_000_000, 2**31]
REAL_FILES = ("terabyte_day0_10k.tsv", "kaggle_train_4571.tsv")


def module(tmp_path: Path, **settings) -> CriteoDataModule:
    settings.setdefault("num_embeddings_per_feature", SIZES)
    return CriteoDataModule(batch_size=64, cache_dir=str(tmp_path / "cache"), cache_workers=1, **settings)


def all_rows(data: CriteoDataModule, split: str):
    source = data.datasets[split].source
    return source.take(np.arange(len(source)))


def assert_same_batch(got_rows, want_rows) -> None:
    """The rows as training batches (KeyedJaggedTensor and all), equal bit for bit."""
    ids = np.arange(len(want_rows))
    got, want = make_batch(got_rows, ids), make_batch(want_rows, ids)
    for name in ("dense_features", "labels", "row_ids"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert torch.equal(got.sparse_features.values(), want.sparse_features.values())
    assert torch.equal(got.sparse_features.lengths(), want.sparse_features.lengths())


def cache_folders(tmp_path: Path) -> list[Path]:
    return sorted(p for p in (tmp_path / "cache").iterdir() if p.is_dir())


def day_mtimes(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in folder.glob("day_*")}


def test_cache_equals_the_direct_parse_bit_for_bit(tmp_path):
    path = tmp_path / "train.tsv"
    write_synthetic_criteo(path, num_rows=3_000, seed=71)
    data = module(tmp_path, train=str(path), shuffle=False)
    data.setup("fit")
    assert_same_batch(all_rows(data, "train"), read_tsv(path, SIZES).take(np.arange(3_000)))
    (folder,) = cache_folders(tmp_path)
    assert np.load(folder / "day_0_sparse.npy", mmap_mode="r").dtype == np.int32  # ids in half the bytes


@pytest.mark.parametrize("name", REAL_FILES)
def test_cache_equals_the_direct_parse_on_real_rows(name, shared_criteo, tmp_path):
    path = shared_criteo / name
    data = module(tmp_path, train=str(path), shuffle=False)
    data.setup("fit")
    want = read_tsv(path, SIZES)
    assert_same_batch(all_rows(data, "train"), want.take(np.arange(len(want))))
    # The cache went to data.cache_dir (whatever a run without it left beside the shared rows).
    (folder,) = cache_folders(tmp_path)
    assert day_mtimes(folder)


def test_cache_is_reused_and_redone_when_an_input_changes(tmp_path, capsys):
    path = tmp_path / "train.tsv"
    write_synthetic_criteo(path, num_rows=500, seed=72)
    module(tmp_path, train=str(path)).setup("fit")
    (folder,) = cache_folders(tmp_path)
    before = day_mtimes(folder)
    capsys.readouterr()
    module(tmp_path, train=str(path)).setup("fit")
    assert day_mtimes(folder) == before  # reused: nothing converted
    assert "preprocessed" not in capsys.readouterr().out
    write_synthetic_criteo(path, num_rows=400, seed=73)  # same name, other rows
    data = module(tmp_path, train=str(path), shuffle=False)
    data.setup("fit")
    assert "converting again" in capsys.readouterr().err
    assert cache_folders(tmp_path) == [folder]
    assert_same_batch(all_rows(data, "train"), read_tsv(path, SIZES).take(np.arange(400)))


def test_a_killed_conversion_resumes(tmp_path, capsys):
    files = []
    for day in range(3):
        files.append(tmp_path / f"day_{day}.tsv")
        write_synthetic_criteo(files[-1], num_rows=200 + day, seed=80 + day)
    spec = [str(p) for p in files]
    module(tmp_path, train=spec).setup("fit")
    (folder,) = cache_folders(tmp_path)
    # What a run killed while writing day 1 leaves: days 0 and 2 done, day 1 half-written, no "complete".
    state = json.loads((folder / CACHE_FILE).read_text())
    (folder / CACHE_FILE).write_text(json.dumps(dict(state, complete=False)))
    for part in ("dense", "sparse", "labels"):
        (folder / f"day_1_{part}.npy").unlink()
    (folder / "day_1_dense.npy.partial").write_bytes(b"half a file")
    kept = {k: v for k, v in day_mtimes(folder).items() if k.startswith(("day_0", "day_2"))}
    capsys.readouterr()
    data = module(tmp_path, train=spec, shuffle=False)
    data.setup("fit")
    assert "resuming an unfinished conversion" in capsys.readouterr().err
    assert {k: v for k, v in day_mtimes(folder).items() if k in kept} == kept  # finished days kept
    assert not (folder / "day_1_dense.npy.partial").exists()
    want = [read_tsv(p, SIZES) for p in files]
    for day in range(3):
        np.testing.assert_array_equal(np.load(folder / f"day_{day}_dense.npy"), want[day].dense)
    assert len(data.datasets["train"].source) == 603


def test_a_cache_made_with_other_options_is_not_used(tmp_path, capsys):
    path = tmp_path / "train.tsv"
    write_synthetic_criteo(path, num_rows=300, seed=74)
    module(tmp_path, train=str(path)).setup("fit")
    capsys.readouterr()
    data = module(tmp_path, train=str(path), shuffle=False, dense_transform="log_plus_3")
    data.setup("fit")
    assert "converting again" in capsys.readouterr().err
    want = read_tsv(path, SIZES, dense_transform="log_plus_3")
    np.testing.assert_array_equal(all_rows(data, "train").dense, want.dense)


def test_ranks_that_wait_get_the_conversion_error(tmp_path):
    """A rank that did not convert stops with the converting rank's error, not a timeout."""
    path = tmp_path / "train.tsv"
    write_synthetic_criteo(path, num_rows=50, seed=75)
    lines = path.read_text().splitlines()
    lines[6] = lines[6].replace("\t", "\tx", 1)  # line 7: I1 is not an integer
    path.write_text("\n".join(lines) + "\n")
    request = CacheRequest((path,), "log1p", "error", tmp_path / "cache", workers=1)
    with pytest.raises(ValueError, match="the rank converting it .local rank 0 of each node, or global rank 0 under data.prepare_data_per_node false. did not finish"):
        cached_days(request, convert=False)  # nothing converted yet
    with pytest.raises(CriteoFormatError, match=r"train\.tsv:7: field I1"):
        cached_days(request)  # the converting rank (local rank 0), in setup
    with pytest.raises(ValueError, match=r"its conversion failed: .*train\.tsv:7: field I1"):
        cached_days(request, convert=False)  # the others, after the strategy's barrier


def test_auto_table_sizes_are_the_exact_distinct_ids_and_the_model_follows(tmp_path):
    rng = np.random.default_rng(5)
    cardinalities = [1 + (7 * j) % 40 for j in range(26)]
    rows = []
    for i in range(200):
        ids = [f"{int(rng.integers(0, c)) * 7919 + j:x}" if i >= c else f"{i * 7919 + j:x}" for j, c in enumerate(cardinalities)]
        rows.append("\t".join([str(i % 2), *map(str, range(13)), *ids]))
    path = tmp_path / "train.tsv"
    path.write_text("\n".join(rows) + "\n")
    args = [
        "fit", "--data.train", str(path), "--data.num_embeddings_per_feature", "auto", "--data.batch_size", "50",
        "--data.cache_dir", str(tmp_path / "cache"), "--data.cache_workers", "1",
        "--model.embedding_dim", "4", "--model.dense_arch_layer_sizes", "[8, 4]",
        "--model.over_arch_layer_sizes", "[8, 1]", "--trainer.max_steps", "1", "--trainer.logger", "false",
        "--trainer.enable_checkpointing", "false", "--trainer.enable_progress_bar", "false",
        "--trainer.default_root_dir", str(tmp_path / "run"),
    ]  # fmt: skip
    # Counted in setup (by the converting ranks, behind the barrier); the model's tables follow in its own.
    (result,) = run_on_ranks(1, args, tmp_path, table_sizes_of_the_run)
    assert result["data"] == result["tables"] == result["hyper_parameters"] == cardinalities


def table_sizes_of_the_run(cli) -> dict:
    """The sizes the data module counted, the model's tables have, and its checkpoints carry."""
    state = cli.model.state_dict()  # the sharded tables, each with its whole size
    tables = [state[f"model.sparse_arch.embedding_bag_collection.embedding_bags.t_cat_{j}.weight"].size(0) for j in range(26)]
    return {
        "data": cli.datamodule.table_sizes, "tables": tables,
        "hyper_parameters": list(cli.model.hparams["num_embeddings_per_feature"]),
    }


def test_each_stage_reads_only_its_splits(tmp_path, sample_dir):
    data = module(tmp_path, train=str(sample_dir / "train.tsv"), test=str(tmp_path / "missing.tsv"),
                  predict=str(tmp_path / "missing_too.tsv"))  # fmt: skip
    data.setup("fit")  # neither test nor predict is looked at
    assert set(data.datasets) == {"train"}
    with pytest.raises(FileNotFoundError, match=r"data\.test: data file or directory .*missing\.tsv' does not exist"):
        data.setup("test")
    with pytest.raises(ValueError, match=r"data\.val is not set"):
        data.setup("validate")


def test_test_with_a_missing_file_stops_with_one_line(tmp_path, sample_dir, capsys):
    from app.cli import cli_main

    args = ["test", "--config", "configs/demo.yaml", "--trainer.devices", "1",
            "--data.train", str(sample_dir / "train.tsv"), "--data.test", str(tmp_path / "missing.tsv"),
            "--data.cache_dir", str(tmp_path / "cache"), "--trainer.logger", "false"]  # fmt: skip
    with pytest.raises(SystemExit) as stopped:
        cli_main(args)
    assert stopped.value.code == 2
    assert "error: data.test: data file or directory" in capsys.readouterr().err


def test_a_truncated_last_line_is_named(tmp_path):
    path = tmp_path / "cut.tsv"
    write_synthetic_criteo(path, num_rows=30, seed=76)
    text = path.read_bytes()
    path.write_bytes(text[: text.rindex(b"\n", 0, len(text) - 1) + 12])  # the last line cut after a few bytes
    with pytest.raises(CriteoFormatError, match=r"cut\.tsv:30: too few fields"):
        module(tmp_path, train=str(path)).setup("fit")


def test_skipped_rows_are_counted_under_a_named_split(tmp_path):
    path = tmp_path / "train.txt"
    write_synthetic_criteo(path, num_rows=700, seed=77)
    lines = path.read_text().splitlines()
    for line in (3, 400, 650):
        lines[line] = lines[line].replace("\t", "\t?", 1)
    path.write_text("\n".join(lines) + "\n")
    data = module(tmp_path, split="kaggle", root=str(path), on_bad_rows="skip")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        data.setup("fit")
    assert data.num_bad_rows_skipped == 3
    assert any("data.root (train.txt): skipped 3 malformed rows" in str(w.message) for w in caught)
    assert len(data.datasets["train"].source) == 598  # 697 rows: days 0-5 of 7 (4 x 100 + 2 x 99)


def test_validate_on_a_named_split_converts_only_the_eval_day(tmp_path):
    root = tmp_path / "terabyte"
    root.mkdir()
    for day in range(24):
        write_synthetic_criteo(root / f"day_{day}", num_rows=10 + day, seed=day)
    data = module(tmp_path, split="terabyte", root=str(root))
    data.setup("validate")
    (folder,) = cache_folders(tmp_path)  # days 0-22 were not converted
    assert folder.name.startswith("day_23-")
    assert len(data.datasets["val"].source) == 17  # first half of day 23's 33 rows


# Converts argv[1:-1] into the cache at argv[-1] on one process; once day 0 is complete (renamed into
# place) it says DAY0 DONE and waits for a line on stdin before day 1: the test kills it there.
KILLED_CONVERSION = """
import sys
from pathlib import Path
import app.data.preprocess.runner as runner
from app.data.cache import CacheRequest, cached_days
convert_day = runner.convert_day
def day_then_wait(task):
    result = convert_day(task)
    if task.day == 0:
        print("DAY0 DONE", flush=True)
        sys.stdin.readline()
    return result
runner.convert_day = day_then_wait
cached_days(CacheRequest(tuple(Path(p) for p in sys.argv[1:-1]), "log1p", "error", Path(sys.argv[-1]), workers=1))
"""


def test_a_conversion_killed_for_real_resumes(tmp_path):
    """SIGKILL the converting process right after its first day is complete; the next run keeps that day."""
    files = []
    for day in range(3):
        files.append(tmp_path / f"day_{day}.tsv")
        write_synthetic_criteo(files[-1], num_rows=2_000, seed=90 + day)
    request = CacheRequest(tuple(files), "log1p", "error", tmp_path / "cache", workers=1)
    command = [sys.executable, "-c", KILLED_CONVERSION, *map(str, files), str(tmp_path / "cache")]
    child = subprocess.Popen(command, cwd=Path(__file__).resolve().parents[2], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        read_until(child.stdout, "DAY0 DONE")
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
    day_0 = request.folder / "day_0_labels.npy"  # renamed into place last of its day
    assert not json.loads((request.folder / CACHE_FILE).read_text())["complete"]
    assert not list(request.folder.glob("day_1_*.npy"))  # killed before day 1 was under its final names
    kept = day_0.stat().st_mtime_ns
    folder = cached_days(request)
    assert day_0.stat().st_mtime_ns == kept  # the finished day was not converted again
    assert json.loads((folder / CACHE_FILE).read_text())["complete"]
    for day, path in enumerate(files):
        np.testing.assert_array_equal(np.load(folder / f"day_{day}_sparse.npy").view(np.uint32), read_tsv(path, [2**32] * 26).sparse)
