"""Runs do not mix in one run folder (app/checkpoint/run_folder.py), through `python -m app` on 2 CPU
processes as a user runs it: a second fit into a folder goes to `<root>-2` and no `-v1` file is ever
written; `--ckpt_path last` is the folder's own last.ckpt beside a stale `last-v1.ckpt`; `best` is
never another run's checkpoint; predict from another run's checkpoint writes into that run's folder
and says what it replaced; a user's checkpoint.dirpath holding another run's checkpoint is refused;
ranks that chose different folders stop; and last.ckpt holds where fit ended, uninterrupted or
killed and resumed (app/checkpoint/run_checkpoint.py)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from app.checkpoint import format as checkpoint_format
from app.checkpoint.best import find_best_checkpoint
from app.checkpoint.run_folder import RUN_FOLDER_VARIABLE, fit_run_folder
from tests.checkpoint.test_checkpoint_runs import REPO, run_app, signal_at, weights
from tests.multiprocess import DEMO_BEFORE_QUALITY_SETTINGS, cli_worker, rendezvous_port

# 12 steps an epoch (1,536 rows, 64 a rank, 2 ranks), 2 epochs, a validation every 6 steps: at 6, 12, 18, 24.
FINAL_STEP = 24
# Ranked by the step, smallest first: the first validation's checkpoint (step 6) stays the best and the
# later validations never rank, the case where Lightning left last.ckpt at the best in an uninterrupted run.
FIRST_VALIDATION_BEST = ["--checkpoint.monitor", "step", "--checkpoint.mode", "min", "--checkpoint.save_top_k", "1"]
BEST_NAME = "epoch=0-step=6.ckpt"


def demo_args(subcommand: str, root: Path, sample: dict[str, Path], *extra: str) -> list[str]:
    """The demo's config on a tiny model and the fixtures' rows (predict scores the 300 validation rows)."""
    return [
        subcommand, "--config", "configs/demo.yaml", *DEMO_BEFORE_QUALITY_SETTINGS,
        "--data.train", str(sample["train"]), "--data.val", str(sample["val"]), "--data.test", "null",
        "--data.predict", str(sample["val"]), "--data.batch_size", "64", "--data.num_embeddings_per_feature", "500",
        "--model.embedding_dim", "8", "--model.dense_arch_layer_sizes", "[16, 8]", "--model.over_arch_layer_sizes", "[16, 1]",
        "--trainer.max_epochs", "2", "--trainer.val_check_interval", "0.5", "--trainer.enable_progress_bar", "false",
        "--trainer.logger", "false", "--trainer.default_root_dir", str(root), *FIRST_VALIDATION_BEST, *extra,
    ]  # fmt: skip


def output(result: subprocess.CompletedProcess) -> str:
    return result.stdout + result.stderr


def last(root: Path) -> checkpoint_format.CheckpointInfo:
    return checkpoint_format.read(root / "checkpoints" / "last.ckpt")


def checkpoint_names(root: Path) -> list[str]:
    return sorted(path.name for path in (root / "checkpoints").glob("*.ckpt"))


def copy_run(root: Path, to: Path) -> Path:
    """A copy of a run folder whose checkpoint links stay links (they are relative: the copy is a run of its own)."""
    shutil.copytree(root, to, symlinks=True)
    return to


@pytest.fixture(scope="module")
def runs(sample, tmp_path_factory) -> dict:
    """`make run`'s run (the demo, dot interaction) in runs/demo, then the DCN example with the same
    config and folder, which goes to runs/demo-2."""
    root = tmp_path_factory.mktemp("runs") / "demo"
    first = run_app(*demo_args("fit", root, sample))
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_app(*demo_args("fit", root, sample, "--config", "configs/demo_dcn.yaml"))
    assert second.returncode == 0, second.stderr[-3000:]
    return {"root": root, "second": Path(f"{root}-2"), "second_log": output(second)}


def test_a_second_fit_into_a_folder_goes_to_root_2_and_each_last_ckpt_is_its_own_run_s(runs):
    root, second = runs["root"], runs["second"]
    assert (
        f"run folder {root} holds another run's checkpoint ({root / 'checkpoints' / 'last.ckpt'}): this fit writes "
        f"into {second} (to continue the run in {root} instead, give --ckpt_path last; to continue this one later, "
        f"--trainer.default_root_dir {second} --ckpt_path last)"
    ) in runs["second_log"]
    # Lightning's versioned names (last-v1.ckpt, epoch=0-step=6-v1.ckpt) nowhere: no run wrote beside another.
    written = [path.name for path in root.parent.rglob("*.ckpt")]
    assert not [name for name in written if re.search(r"-v\d+\.ckpt$", name)], written
    assert checkpoint_names(root) == checkpoint_names(second) == [BEST_NAME, "last.ckpt"]
    assert last(root).meta["hyper_parameters"]["interaction"] == "dot"
    assert last(second).meta["hyper_parameters"]["interaction"] == "dcn"
    assert sorted(path.name for path in root.parent.iterdir()) == ["demo", "demo-2"]


def test_ckpt_path_last_resumes_the_folder_s_own_last_ckpt_beside_another_run_s_newer_last_v1(runs, sample, tmp_path):
    """The folder as Lightning left it when runs shared one: another run's (the DCN's) last-v1.ckpt, written
    later. Lightning's `last` is the newest last*.ckpt, which stopped this resume on the model mismatch."""
    root = copy_run(runs["root"], tmp_path / "demo")
    shutil.copytree(runs["second"] / "checkpoints" / "last.ckpt", root / "checkpoints" / "last-v1.ckpt")  # as cp -rL
    resumed = run_app(*demo_args("fit", root, sample, "--ckpt_path", "last", "--trainer.max_epochs", "3"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"Restoring states from the checkpoint path at {root / 'checkpoints' / 'last.ckpt'}\n" in output(resumed)
    assert "holds another run's checkpoint" not in output(resumed)  # resumed in place
    assert (last(root).meta["global_step"], last(root).meta["hyper_parameters"]["interaction"]) == (FINAL_STEP + 12, "dot")
    # A copied (or moved) folder: Lightning restores no last_model_path for it and would version the name.
    assert "last-v2.ckpt" not in checkpoint_names(root)


def test_best_is_recorded_by_the_folder_s_last_ckpt_and_never_another_run_s_checkpoint(runs, tmp_path):
    root = copy_run(runs["root"], tmp_path / "demo")
    shutil.copytree(runs["second"] / "checkpoints" / "last.ckpt", root / "checkpoints" / "last-v1.ckpt")
    os.utime(root / "checkpoints" / "last-v1.ckpt" / "meta.json")  # the newer of two records at the same step
    best = find_best_checkpoint(root / "checkpoints", "step", "min")
    assert (best.path, best.recorded_in.name, best.score) == (root / "checkpoints" / BEST_NAME, "last.ckpt", 6.0)
    # last.ckpt of the DCN run beside the dot run's checkpoints: it names its own epoch=0-step=6.ckpt,
    # and the one of that name here is the dot run's (its own record names another path).
    (root / "checkpoints" / "last.ckpt").unlink()
    (root / "checkpoints" / "last-v1.ckpt").rename(root / "checkpoints" / "last.ckpt")
    with pytest.raises(FileNotFoundError) as refused:
        find_best_checkpoint(root / "checkpoints", "step", "min")
    assert str(refused.value) == (
        f"ckpt_path best: last.ckpt records {runs['second'] / 'checkpoints' / BEST_NAME} as the best by step (6), but "
        f"{root / 'checkpoints' / BEST_NAME} is another run's checkpoint of that name (its own record lists no such "
        "path and score); give a checkpoint path"
    )


def test_predict_from_another_run_s_checkpoint_writes_into_that_run_and_says_what_it_replaced(runs, sample, tmp_path):
    root, dcn = runs["root"], copy_run(runs["second"], tmp_path / "dcn")
    best, newest = dcn / "checkpoints" / BEST_NAME, dcn / "checkpoints" / "last.ckpt"
    # The demo's config (default_root_dir: the dot run's folder), another run's checkpoints.
    first = run_app(*demo_args("predict", root, sample, "--ckpt_path", str(best)))
    assert first.returncode == 0, first.stderr[-3000:]
    assert f"wrote 300 predictions of {best} at step 6 on {sample['val']} to {dcn / 'predictions.tsv'}\n" in output(first)
    second = run_app(*demo_args("predict", root, sample, "--ckpt_path", str(newest)))
    assert second.returncode == 0, second.stderr[-3000:]
    assert (
        f"wrote 300 predictions of {newest} at step {FINAL_STEP} on {sample['val']} to {dcn / 'predictions.tsv'}, "
        f"replacing 300 predictions of {best} at step 6 on {sample['val']}\n"
    ) in output(second)
    assert json.loads((dcn / "predictions.json").read_text()) == {
        "checkpoint": str(newest), "global_step": FINAL_STEP, "inputs": [str(sample["val"])], "rows": 300,
    }  # fmt: skip
    assert len((dcn / "predictions.tsv").read_text().splitlines()) == 301
    assert not (root / "predictions.tsv").exists() and not (root / "predictions.json").exists()


def test_a_checkpoint_dirpath_the_user_set_holding_another_run_s_checkpoint_is_refused(runs, sample, tmp_path):
    folder = runs["root"] / "checkpoints"
    before = checkpoint_names(runs["root"])
    refused = run_app(*demo_args("fit", tmp_path / "new", sample, "--checkpoint.dirpath", str(folder)))
    assert refused.returncode == 2
    assert [line for line in refused.stderr.splitlines() if line.startswith("error:")] == [
        f"error: checkpoint.dirpath = {folder} holds another run's checkpoint ({folder / 'last.ckpt'}) and this fit "
        "does not continue it: continue that run with --ckpt_path last, or set another checkpoint.dirpath (unset: a "
        "new run folder is chosen)"
    ]
    assert not (tmp_path / "new").exists() and checkpoint_names(runs["root"]) == before


def test_last_ckpt_holds_where_fit_ended_uninterrupted_and_after_a_kill_and_resume(runs, sample, tmp_path):
    """Lightning left last.ckpt at step 6 (the best) in the uninterrupted run but saved it at step 24 at
    the end of the resumed one; here both end with last.ckpt at step 24, the same weights, the same best."""
    uninterrupted, killed = runs["root"], tmp_path / "killed"
    run = run_app(*demo_args("fit", killed, sample), *signal_at("SIGKILL", 9))
    assert run.returncode == -signal.SIGKILL, run.stderr[-3000:]
    assert last(killed).meta["global_step"] == 6  # the first validation's save; the job died 3 steps later
    resumed = run_app(*demo_args("fit", killed, sample, "--ckpt_path", "last"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert last(uninterrupted).meta["global_step"] == last(killed).meta["global_step"] == FINAL_STEP
    expected, actual = weights(uninterrupted, tmp_path), weights(killed, tmp_path)
    assert expected.keys() == actual.keys()
    for key in expected:
        assert torch.equal(expected[key], actual[key]), key
    for root in (uninterrupted, killed):
        assert find_best_checkpoint(root / "checkpoints", "step", "min").path == root / "checkpoints" / BEST_NAME


def _rank_with_its_own_args(rank: int, world_size: int, port: int, args_by_rank: list[list[str]], out_dir: str, env: dict) -> None:
    cli_worker(rank, world_size, port, args_by_rank[rank], None, out_dir, env)


def test_ranks_that_chose_different_run_folders_all_stop_with_the_same_line(sample, tmp_path):
    """As under torchrun when a checkpoint appears between the ranks' parses: each rank chose another folder."""
    import pickle

    roots = [tmp_path / "rank0_chose", tmp_path / "rank1_chose"]
    args_by_rank = [demo_args("fit", root, sample) for root in roots]
    with rendezvous_port() as port:
        mp.start_processes(_rank_with_its_own_args, args=(2, port, args_by_rank, str(tmp_path), dict(os.environ)),
                           nprocs=2, start_method="forkserver")  # fmt: skip
    errors = [pickle.loads((tmp_path / f"rank{rank}.pkl").read_bytes()).get("error", "") for rank in range(2)]
    line = (
        f"ValueError: the ranks chose different run folders (rank 0: {roots[0]}; rank 1: {roots[1]}): a checkpoint "
        "appeared in the folder while they started (another job writing there?); start the job again, or set "
        "trainer.default_root_dir to a folder of its own"
    )
    assert [error.splitlines()[0] for error in errors] == [line, line]
    assert not [path for root in roots for path in root.rglob("*") if path.is_file()]  # stopped before any work


# Each case sets the launcher's variable and LOCAL_RANK as a started process would find them, then chooses.
CHILD = """
import json, os, sys
from app.checkpoint.run_folder import RUN_FOLDER_VARIABLE, fit_run_folder
chosen = []
for case in json.loads(sys.argv[1]):
    os.environ[RUN_FOLDER_VARIABLE] = json.dumps(case["decision"])
    os.environ.pop("LOCAL_RANK", None)
    if case["local_rank"] is not None:
        os.environ["LOCAL_RANK"] = case["local_rank"]
    chosen.append(fit_run_folder(case["decision"]["asked"], None, None))
print(json.dumps(chosen))
"""


def test_a_rank_started_by_the_launching_process_takes_its_choice(tmp_path):
    """Lightning's launcher starts the other local ranks (LOCAL_RANK > 0) after the first one parsed, with its
    environment; a first process whose parent parsed a fit in-process (a notebook, a test runner) chooses
    for itself, as does one whose variable was left by a process that is not its parent. One child process
    takes every case (its parent is this process)."""
    asked = str(tmp_path / "run")
    other = subprocess.Popen([sys.executable, "-c", "pass"])
    other.wait()  # a variable left by a process that is no one's parent here (an earlier run, a shell's)
    # (variable's pid, LOCAL_RANK, whether the child takes the variable's choice)
    cases = [(os.getpid(), "1", True), (other.pid, "1", False), (os.getpid(), None, False), (os.getpid(), "0", False)]
    request = [{"decision": {"pid": pid, "asked": asked, "root": f"{asked}-7"}, "local_rank": rank} for pid, rank, _ in cases]
    child = subprocess.run([sys.executable, "-c", CHILD, json.dumps(request)], capture_output=True, text=True, cwd=REPO, check=True)
    assert json.loads(child.stdout) == [f"{asked}-7" if inherits else asked for _, _, inherits in cases]
    assert fit_run_folder(asked, None, None) == asked  # this process chooses for itself: nothing to continue here
