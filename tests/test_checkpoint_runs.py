"""Checkpoints through `python -m app` as a user runs it (Lightning's launcher, 2 CPU processes):
SIGKILL of the whole job and `--ckpt_path last` give the uninterrupted run's result bit for bit; a
pre-emption signal to one rank saves a complete checkpoint on every rank; a bad checkpoint stops
every rank with one message; each run owns its folder."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from app.checkpoint import format as checkpoint_format
from multiprocess import DEMO_BEFORE_QUALITY_SETTINGS

TIMEOUT_S = 300
# Launcher settings an in-process CLI test may have left in this process's environment: each run here
# lets Lightning's launcher choose its own free port.
_LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", "GLOBAL_RANK")


def app_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARIABLES}
    return {**env, "PYTHONPATH": str(Path.cwd())}


def run_app(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "app", *args], capture_output=True, text=True, timeout=TIMEOUT_S, env=app_env()
    )


def fit_args(sample: dict[str, Path], root: Path) -> list[str]:
    """A tiny model, 12 steps per epoch, 3 epochs, last.ckpt every 4 steps, both loggers."""
    return [
        "fit", "--config", "configs/demo.yaml", *DEMO_BEFORE_QUALITY_SETTINGS,
        "--data.train", str(sample["train"]), "--data.val", str(sample["val"]),
        "--data.test", "null", "--data.predict", "null",
        "--data.batch_size", "64", "--data.num_embeddings_per_feature", "500",
        "--model.embedding_dim", "8", "--model.dense_arch_layer_sizes", "[16, 8]",
        "--model.over_arch_layer_sizes", "[16, 1]",
        "--trainer.max_epochs", "3", "--trainer.enable_progress_bar", "false",
        "--trainer.default_root_dir", str(root),
        "--checkpoint.every_n_train_steps", "4", "--checkpoint.monitor", "null", "--checkpoint.save_top_k", "0",
    ]  # fmt: skip


def start_app(args: list[str]) -> subprocess.Popen:
    env = app_env()
    # A session of its own, so that the test can kill the whole job (both ranks) at once.
    return subprocess.Popen(
        [sys.executable, "-m", "app", *args], env=env, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def last_step(root: Path) -> int:
    """The global step of the published last.ckpt (-1 while none)."""
    try:
        return json.loads((root / "checkpoints" / "last.ckpt" / "meta.json").read_text())["global_step"]
    except (FileNotFoundError, json.JSONDecodeError):
        return -1


def wait_for_step(process: subprocess.Popen, root: Path, step: int) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while last_step(root) < step:
        assert process.poll() is None, process.stdout.read()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.02)


def weights(root: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    single_file = tmp_path / f"{root.name}.pt"
    dcp_to_torch_save(root / "checkpoints" / "last.ckpt", single_file)
    return torch.load(single_file, weights_only=True)["state_dict"]


def final_val_metrics(root: Path) -> dict[str, str]:
    rows = []
    for path in sorted(root.glob("csv/version_*/metrics.csv")):
        with path.open() as f:
            rows += [row for row in csv.DictReader(f) if row.get("val/auc")]
    return {k: v for k, v in rows[-1].items() if k.startswith("val/")}


@pytest.fixture(scope="module")
def uninterrupted(sample, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("uninterrupted")
    result = run_app(*fit_args(sample, root))
    assert result.returncode == 0, result.stderr[-3000:]
    return root


@pytest.fixture(scope="module")
def killed_and_resumed(sample, tmp_path_factory) -> tuple[Path, str]:
    """The same run SIGKILLed (both ranks at once) after step 16 was checkpointed, then resumed from last."""
    root = tmp_path_factory.mktemp("killed")
    job = start_app(fit_args(sample, root))
    wait_for_step(job, root, 16)  # the second epoch (12 steps per epoch); the kill lands a few steps later
    os.killpg(job.pid, signal.SIGKILL)
    job.wait(timeout=30)
    assert job.returncode == -signal.SIGKILL
    killed_at = last_step(root)
    assert 16 <= killed_at < 36, killed_at
    resumed = run_app(*fit_args(sample, root), "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return root, resumed.stdout + resumed.stderr


def test_sigkill_of_the_job_and_resume_from_last_is_bit_identical(uninterrupted, killed_and_resumed, tmp_path):
    root, log = killed_and_resumed
    assert f"Restoring states from the checkpoint path at {root / 'checkpoints' / 'last.ckpt'}" in log
    assert f"TorchRec sharding plan (2 ranks, as saved in {root / 'checkpoints' / 'last.ckpt'})" in log
    expected, actual = weights(uninterrupted, tmp_path), weights(root, tmp_path)
    assert expected.keys() == actual.keys()
    for key in expected:
        assert torch.equal(expected[key], actual[key]), key
    assert final_val_metrics(root) == final_val_metrics(uninterrupted)


def test_two_runs_with_their_own_root_share_no_file(uninterrupted, killed_and_resumed):
    roots = (uninterrupted, killed_and_resumed[0])
    files = [{p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()} for root in roots]
    for root, written in zip(roots, files):
        assert {"sharding_plan.json", "csv/version_0/metrics.csv", "csv/version_0/config.yaml"} <= written
        assert any(f.startswith("tensorboard/version_0/events") for f in written)
        assert any(f.startswith("checkpoints/.last.ckpt.") and f.endswith("meta.json") for f in written)
        # The saved config names this run's folder, so a resumed run writes into it again.
        assert f"default_root_dir: {root}" in (root / "csv/version_0/config.yaml").read_text()
    # The resumed run added a log version beside the killed one, and overwrote nothing of the other run.
    assert "csv/version_1/metrics.csv" in files[1] and "csv/version_1/metrics.csv" not in files[0]
    assert not roots[0].is_relative_to(roots[1]) and not roots[1].is_relative_to(roots[0])


def test_sigusr1_to_one_rank_saves_on_every_rank_and_stops_keeping_the_newest_two(sample, tmp_path):
    root = tmp_path / "preempted"
    keep_newest_2 = ["--checkpoint.monitor", "step", "--checkpoint.mode", "max", "--checkpoint.save_top_k", "2",
                     "--checkpoint.filename", "{step}"]  # fmt: skip
    job = start_app(fit_args(sample, root) + ["--trainer.max_epochs", "50"] + keep_newest_2)
    wait_for_step(job, root, 12)
    ranks = [job.pid] + children(job.pid)
    assert len(ranks) >= 2, ranks
    os.kill(ranks[-1], signal.SIGUSR1)  # only the second rank hears it
    output, _ = job.communicate(timeout=TIMEOUT_S)
    assert job.returncode == 0, output[-3000:]
    assert "saved" in output and "stopping (resume with --ckpt_path last)" in output, output[-3000:]
    info = checkpoint_format.read(root / "checkpoints" / "last.ckpt")
    assert 12 <= info.meta["global_step"] < 50 * 12
    assert info.world_size == 2
    # Keep-last-N of the periodic checkpoints: the newest two by step, each a complete folder.
    periodic = sorted((p.name for p in (root / "checkpoints").glob("step=*.ckpt")), key=lambda n: int(n[5:-5]))
    newest = info.meta["global_step"] // 4 * 4
    assert periodic == [f"step={newest - 4}.ckpt", f"step={newest}.ckpt"], periodic
    assert len(list((root / "checkpoints").glob(".*.ckpt.*"))) == 3


def children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.parametrize(
    "how, message",
    [
        ("missing_shard", "shard file __1_0.distcp is missing"),
        ("other_tables", "does not fit this model: model.sparse_arch.embedding_bag_collection.embedding_bags.t_cat_0.weight is [500, 8] there, [400, 8] here"),
    ],
)  # fmt: skip
def test_a_bad_checkpoint_stops_every_rank_with_one_message(how, message, uninterrupted, sample, tmp_path):
    import shutil

    path = tmp_path / "copy.ckpt"
    extra = []
    shutil.copytree(uninterrupted / "checkpoints" / "last.ckpt", path)
    if how == "missing_shard":
        (path / "__1_0.distcp").unlink()
    if how == "other_tables":
        extra = ["--data.num_embeddings_per_feature", "400"]
    args = fit_args(sample, tmp_path / "run") + extra + ["--ckpt_path", str(path)]
    started = time.monotonic()
    result = run_app("validate", *args[1:])
    assert time.monotonic() - started < 120
    assert result.returncode != 0
    assert f"error: ckpt_path {path}" in result.stderr and message in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
