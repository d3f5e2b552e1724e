"""Checkpoints through `python -m app` as a user runs it (Lightning's launcher, 2 CPU processes):
SIGKILL of the whole job and `--ckpt_path last` give the uninterrupted run's result bit for bit, and
so does a SIGTERM to the whole job during a validation; a pre-emption signal to one rank saves a
complete checkpoint on every rank; a bad checkpoint stops every rank with one message; each run owns
its folder. The kills and signals come from inside the run at an exact step
(tests/checkpoint/preemption_callbacks.py), so what was saved is known exactly. SLURM's side of pre-emption
(requeue, a save longer than the warning) is in tests/checkpoint/test_preemption.py."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from app.checkpoint import format as checkpoint_format
from tests.multiprocess import DEMO_BEFORE_QUALITY_SETTINGS

TIMEOUT_S = 300
REPO = Path(__file__).resolve().parents[2]  # on PYTHONPATH: the test-only callbacks are tests.<group>.<module>.<Class>
# Launcher settings an in-process CLI test may have left in this process's environment: each run here
# lets Lightning's launcher choose its own free port.
_LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", "GLOBAL_RANK")


def app_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARIABLES}
    return {**env, "PYTHONPATH": str(REPO)}  # the repository: the test callbacks are tests.checkpoint.*


def run_app(*args: str) -> subprocess.CompletedProcess:
    """Runs ``python -m app ARGS`` as a job of its own: a new process group (both ranks and their loader
    workers), which the test callbacks signal as a scheduler would, and which is killed whole if it
    outlives TIMEOUT_S (a hang fails the test)."""
    job = subprocess.Popen(
        [sys.executable, "-m", "app", *args], env=app_env(), process_group=0,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        stdout, stderr = job.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        stdout, stderr = job.communicate()
        pytest.fail(f"python -m app {args[0]} still running after {TIMEOUT_S} s (a hang):\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(job.args, job.returncode, stdout, stderr)


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


def signal_at(signal_name: str, step: int, *options: str) -> list[str]:
    """Arguments that make the run send ``signal_name`` at ``step`` (tests/checkpoint/preemption_callbacks.py)."""
    return ["--trainer.callbacks+=tests.checkpoint.preemption_callbacks.SignalAt", "--trainer.callbacks.signal_name", signal_name,
            "--trainer.callbacks.step", str(step), *options]  # fmt: skip


def last_step(root: Path) -> int:
    """The global step of the published last.ckpt (after checking that it is complete)."""
    return checkpoint_format.read(root / "checkpoints" / "last.ckpt").meta["global_step"]


def weights(root: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    single_file = tmp_path / f"{root.name}.pt"
    dcp_to_torch_save(root / "checkpoints" / "last.ckpt", single_file)
    return torch.load(single_file, weights_only=True)["state_dict"]


def validation_rows(root: Path) -> list[dict[str, str]]:
    """Every validation the run's CSV logger wrote, across the versions of its restarts, in order."""
    rows = []
    for path in sorted(root.glob("csv/version_*/metrics.csv")):
        with path.open() as f:
            rows += [row for row in csv.DictReader(f) if row.get("val/auc")]
    return rows


def final_val_metrics(root: Path) -> dict[str, str]:
    return {k: v for k, v in validation_rows(root)[-1].items() if k.startswith("val/")}


@pytest.fixture(scope="module")
def uninterrupted(sample, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("uninterrupted")
    result = run_app(*fit_args(sample, root))
    assert result.returncode == 0, result.stderr[-3000:]
    return root


@pytest.fixture(scope="module")
def killed_and_resumed(sample, tmp_path_factory) -> tuple[Path, str]:
    """The same run on the same rows written as Parquet (``python -m app.data.to_parquet``, whose cached
    days are the TSV's byte for byte: tests/data/test_parquet.py), SIGKILLed (the whole job: both ranks
    at once) at step 18, two steps after step 16 was checkpointed, then resumed from last: the Parquet
    road's kill and resume (the TSV road's: tests/checkpoint/test_run_folder.py)."""
    from app.data.to_parquet import to_parquet

    root = tmp_path_factory.mktemp("killed")
    for split in ("train", "val"):
        to_parquet(str(sample[split]), str(root.parent / "parquet"), row_group_rows=500)  # several row groups
    parquet = {split: root.parent / "parquet" / f"{split}.parquet" for split in ("train", "val")}
    killed = run_app(*fit_args(parquet, root), *signal_at("SIGKILL", 18))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert last_step(root) == 16
    resumed = run_app(*fit_args(parquet, root), "--ckpt_path", "last")
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
    only_rank_1 = signal_at("SIGUSR1", 14, "--trainer.callbacks.rank", "1", "--trainer.callbacks.to", "self")
    result = run_app(*fit_args(sample, root), "--trainer.max_epochs", "50", "--save_on_signal.check_every_n_steps", "1",
                     *keep_newest_2, *only_rank_1)  # fmt: skip
    # Not SLURM, so nobody requeues it: the run did not finish and says so, as a process killed by SIGUSR1 would.
    assert result.returncode == 128 + signal.SIGUSR1, result.stderr[-3000:]
    output = result.stdout + result.stderr
    # Rank 0 never got the signal: it saved because the ranks agreed on rank 1's.
    assert f"a signal on another rank: saved {root / 'checkpoints' / 'last.ckpt'} at step 14; stopping" in output
    info = checkpoint_format.read(root / "checkpoints" / "last.ckpt")
    assert info.meta["global_step"] == 14
    assert info.world_size == 2
    # Keep-last-N of the periodic checkpoints: the newest two by step, each a complete folder.
    periodic = sorted((p.name for p in (root / "checkpoints").glob("step=*.ckpt")), key=lambda n: int(n[5:-5]))
    assert periodic == ["step=8.ckpt", "step=12.ckpt"], periodic
    assert len(list((root / "checkpoints").glob(".*.ckpt.*"))) == 3


def test_sigterm_to_the_whole_job_during_validation_saves_at_once_and_resumes_bit_identical(uninterrupted, sample, tmp_path):
    """SIGTERM to every process (both ranks and their persistent loader workers) during the first batch
    of the validation after step 12: the ranks agree at that validation batch, save step 12's state and
    end without finishing the validation; the resumed run ends where the uninterrupted one does."""
    root = tmp_path / "preempted"
    with_workers = ["--data.num_workers", "1", "--save_on_signal.check_every_n_steps", "1",
                    "--checkpoint.every_n_train_steps", "9"]  # fmt: skip  (periodic saves at 9, 18, .., 36: not 12)
    during_validation = signal_at("SIGTERM", 12, "--trainer.callbacks.at", "validation")
    result = run_app(*fit_args(sample, root), *with_workers, *during_validation)
    output = result.stdout + result.stderr
    assert result.returncode == 128 + signal.SIGTERM, output[-3000:]  # 143: a Kubernetes Job restarts it
    assert f"SIGTERM: saved {root / 'checkpoints' / 'last.ckpt'} at step 12; stopping" in output, output[-3000:]
    assert last_step(root) == 12
    assert not (root / "csv" / "version_0" / "metrics.csv").exists() or "val/auc" not in (
        root / "csv" / "version_0" / "metrics.csv"
    ).read_text()  # the interrupted validation logged nothing
    resumed = run_app(*fit_args(sample, root), *with_workers, "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    expected, actual = weights(uninterrupted, tmp_path), weights(root, tmp_path)
    for key in expected:
        assert torch.equal(expected[key], actual[key]), key
    assert final_val_metrics(root) == final_val_metrics(uninterrupted)


@pytest.mark.parametrize(
    "how, message",
    [
        ("missing_shard", "error: ckpt_path {path}: shard file __1_0.distcp is missing"),
        # Its metadata says 400 rows a table (the model is built so), its shards hold 500: found by the strategy.
        ("tables_unlike_its_metadata", "error: ckpt_path {path} does not fit this model: "
         "model.sparse_arch.embedding_bag_collection.embedding_bags.t_cat_0.weight is [500, 8] there, [400, 8] here"),
        # A setting that contradicts the model it carries: refused before any rank starts.
        ("contradicting_setting", "error: data.num_embeddings_per_feature = 400 here, but ckpt_path {path} holds a "
         "model with data.num_embeddings_per_feature = [500, 500,"),
    ],
)  # fmt: skip
def test_a_bad_checkpoint_stops_every_rank_with_one_message(how, message, uninterrupted, sample, tmp_path):
    import shutil

    path = tmp_path / "copy.ckpt"
    extra = []
    shutil.copytree(uninterrupted / "checkpoints" / "last.ckpt", path)
    if how == "missing_shard":
        (path / "__1_0.distcp").unlink()
    if how == "tables_unlike_its_metadata":
        meta = json.loads((path / "meta.json").read_text())
        meta["hyper_parameters"]["num_embeddings_per_feature"] = [400] * 26
        (path / "meta.json").write_text(json.dumps(meta))
        extra = ["--data.num_embeddings_per_feature", "auto"]  # the checkpoint's, as its metadata says
    if how == "contradicting_setting":
        extra = ["--data.num_embeddings_per_feature", "400"]
    args = fit_args(sample, tmp_path / "run") + extra + ["--ckpt_path", str(path)]
    result = run_app("validate", *args[1:])  # a rank left waiting fails it through run_app's timeout
    assert result.returncode != 0
    assert message.format(path=path) in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
