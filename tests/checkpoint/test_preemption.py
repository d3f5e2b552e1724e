"""Pre-emption as SLURM does it, on one machine: two srun-like tasks (fake ``SLURM_*`` variables, one
process group), loader workers on (persistent), the signal sent to the whole group (ranks and workers)
from inside the run at an exact step, and a stand-in ``scontrol`` on PATH that records its arguments and
then does to the job what SLURM's requeue does (SIGTERM to every process; with ``KillWait`` 0, SIGKILL).
Last, the requeue call on its own: the job or array task it names, and a machine without ``scontrol``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from app.checkpoint import format as checkpoint_format
from app.data.loader import ignore_preemption_signals
from tests.multiprocess import AGENT_STORE, DEMO_BEFORE_QUALITY_SETTINGS, rendezvous_port
from tests.checkpoint.test_checkpoint_runs import validation_rows

REPO = Path(__file__).resolve().parents[2]  # on PYTHONPATH: the test-only callbacks are tests.<group>.<module>.<Class>
LIMIT_S = 240  # a whole run on a busy 2-core machine is well under this; a hang fails the test
JOB_ID = "4242"

FAKE_SCONTROL = """#!{python}
import os, signal, sys
with open(os.environ["FAKE_SCONTROL_LOG"], "a") as log:
    log.write(" ".join(sys.argv[1:]) + "\\n")
# What SLURM does to a running job it requeues: SIGTERM to all its processes, SIGKILL KillWait later.
signal.signal(signal.SIGTERM, signal.SIG_IGN)
os.killpg(os.getpgid(0), signal.SIGTERM)
if os.environ.get("FAKE_SCONTROL_KILL_WAIT_S") == "0":
    os.killpg(os.getpgid(0), signal.SIGKILL)
"""


def fit_args(sample: dict[str, Path], root: Path, *extra: str) -> list[str]:
    """12 steps per epoch, a checkpoint every 4 steps keeping the newest two, one loader worker per rank."""
    return [
        "fit", "--config", "configs/demo.yaml", *DEMO_BEFORE_QUALITY_SETTINGS,
        "--data.train", str(sample["train"]), "--data.val", str(sample["val"]),
        "--data.test", "null", "--data.predict", "null", "--data.num_workers", "1",
        "--data.batch_size", "64", "--data.num_embeddings_per_feature", "500",
        "--model.embedding_dim", "8", "--model.dense_arch_layer_sizes", "[16, 8]",
        "--model.over_arch_layer_sizes", "[16, 1]",
        "--trainer.max_epochs", "50", "--trainer.devices", "2", "--trainer.enable_progress_bar", "false",
        "--trainer.default_root_dir", str(root),
        "--checkpoint.every_n_train_steps", "4", "--checkpoint.monitor", "step", "--checkpoint.mode", "max",
        "--checkpoint.save_top_k", "2", "--checkpoint.filename", "{step}",
        *extra,
    ]  # fmt: skip


def run_slurm_job(
    args: list[str], tmp_path: Path, kill_wait_s: str = "", with_scontrol: bool = True
) -> tuple[list[int], list[str], str]:
    """Runs ``args`` as the two tasks of SLURM job 4242 on this machine, in one process group; returns
    their exit codes, their logs and what the stand-in scontrol recorded (``with_scontrol`` false: none on
    PATH, as in a container without SLURM's tools)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if with_scontrol:
        scontrol = bin_dir / "scontrol"
        scontrol.write_text(FAKE_SCONTROL.format(python=sys.executable))
        scontrol.chmod(0o755)
    elif shutil.which("scontrol"):
        pytest.skip(f"a real scontrol is on PATH here ({shutil.which('scontrol')}): this test would requeue a real job")
    scontrol_log = tmp_path / "scontrol.log"
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "APP_TRACEBACK"))}
    base.update({
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1",
        "FAKE_SCONTROL_LOG": str(scontrol_log), "FAKE_SCONTROL_KILL_WAIT_S": kill_wait_s,
        "SLURM_JOB_ID": JOB_ID, "SLURM_JOB_NAME": "dlrm", "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_NNODES": "1", "SLURM_NODELIST": "127.0.0.1", "SLURM_NODEID": "0", **AGENT_STORE,
    })  # fmt: skip
    logs = [tmp_path / f"task{rank}.log" for rank in (0, 1)]
    with rendezvous_port() as port:
        returncodes = _run_tasks(args, {**base, "MASTER_PORT": str(port)}, logs)
    recorded = scontrol_log.read_text() if scontrol_log.exists() else ""
    return returncodes, [log.read_text() for log in logs], recorded


def _run_tasks(args: list[str], base: dict[str, str], logs: list[Path]) -> list[int]:
    tasks: list[subprocess.Popen] = []
    try:
        for rank, log in enumerate(logs):
            env = {**base, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank)}
            # One process group for the job, as srun's step: task 0 leads it, task 1 joins it.
            group = tasks[0].pid if tasks else 0  # 0: a new group, led by task 0
            with log.open("w") as out:
                tasks.append(subprocess.Popen([sys.executable, "-m", "app", *args], stdout=out,
                                              stderr=subprocess.STDOUT, env=env, process_group=group))  # fmt: skip
        return [task.wait(timeout=LIMIT_S) for task in tasks]
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running after {LIMIT_S} s (a hang):\n{logs[0].read_text()[-3000:]}")
    finally:
        if tasks and any(task.poll() is None for task in tasks):
            os.killpg(tasks[0].pid, signal.SIGKILL)  # the whole job: both tasks and their loader workers
        for task in tasks:
            task.wait()


def checkpoint_names(root: Path) -> list[str]:
    """The published checkpoints (links), without the folders they point at."""
    return sorted(p.name for p in (root / "checkpoints").iterdir() if not p.name.startswith("."))


def last_step(root: Path) -> int:
    return checkpoint_format.read(root / "checkpoints" / "last.ckpt").meta["global_step"]


def test_sigusr1_to_the_whole_slurm_job_saves_at_the_next_check_requeues_and_ends_without_validation(sample, tmp_path):
    """SIGUSR1 to every process of the job (ranks and loader workers) after step 10; the ranks check every
    4 steps, so they save at step 12 -- the last batch of the epoch, where Lightning would validate and
    ModelCheckpoint save next -- requeue, and end: no validation, no other checkpoint."""
    root = tmp_path / "run"
    args = fit_args(sample, root, "--save_on_signal.check_every_n_steps", "4",
                    "--trainer.callbacks+=tests.checkpoint.preemption_callbacks.SignalAt", "--trainer.callbacks.signal_name", "SIGUSR1",
                    "--trainer.callbacks.step", "10")  # fmt: skip
    returncodes, logs, scontrol = run_slurm_job(args, tmp_path)

    assert returncodes == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    assert f"SIGUSR1: saved {root / 'checkpoints' / 'last.ckpt'} at step 12; stopping without further validation" in logs[0]
    assert last_step(root) == 12
    assert scontrol == f"requeue {JOB_ID}\n"  # once, by rank 0, after the save
    # Only the periodic saves before the signal besides it (no step=12.ckpt, no save at validation's end).
    assert checkpoint_names(root) == ["last.ckpt", "step=4.ckpt", "step=8.ckpt"]
    assert validation_rows(root) == []
    assert not list(root.rglob("hpc_ckpt*")), "Lightning's SLURM handler saved a checkpoint of its own"
    assert "DataLoader worker" not in logs[0] + logs[1]


def test_without_scontrol_the_checkpoint_is_saved_and_rank_0_exits_non_zero(sample, tmp_path):
    """A container without SLURM's tools: the save happens, the requeue cannot; one warning names the job,
    no traceback, and rank 0 exits 128 + SIGUSR1 so the job reads as not finished (srun reports the highest)."""
    root = tmp_path / "run"
    args = fit_args(sample, root, "--save_on_signal.check_every_n_steps", "4",
                    "--trainer.callbacks+=tests.checkpoint.preemption_callbacks.SignalAt", "--trainer.callbacks.signal_name", "SIGUSR1",
                    "--trainer.callbacks.step", "10")  # fmt: skip
    returncodes, logs, _ = run_slurm_job(args, tmp_path, with_scontrol=False)

    assert returncodes == [128 + signal.SIGUSR1, 0], logs[0][-3000:] + logs[1][-3000:]
    assert f"scontrol is not on PATH here: SLURM job {JOB_ID} was not requeued" in logs[0], logs[0][-3000:]
    assert "Traceback" not in logs[0] + logs[1]
    assert last_step(root) == 12


def test_a_signal_before_training_stops_every_rank_without_a_save_and_requeues(sample, tmp_path):
    """SIGUSR1 to the whole job in the setup hook (after the raw-TSV conversion, before Lightning installs its
    handlers): nothing was trained, so nothing is saved; the ranks stop and the job is requeued."""
    root = tmp_path / "run"
    args = fit_args(sample, root, "--trainer.callbacks+=tests.checkpoint.preemption_callbacks.SignalAt",
                    "--trainer.callbacks.at", "setup",
                    "--trainer.callbacks+=tests.checkpoint.preemption_callbacks.ReportSignalsAtExit")  # fmt: skip
    returncodes, logs, scontrol = run_slurm_job(args, tmp_path)

    assert returncodes == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    # The requeue's SIGTERM reaches rank 1 while it exits: ignored there, not its default action (a kill).
    assert all("at exit: SIGTERM ignored, SIGUSR1 ignored" in log for log in logs), logs[1][-3000:]
    assert "SIGUSR1: nothing trained since the run started, no save; stopping" in logs[0], logs[0][-3000:]
    assert scontrol == f"requeue {JOB_ID}\n"
    assert not (root / "checkpoints").exists() or checkpoint_names(root) == []
    assert not list(root.rglob("hpc_ckpt*"))


def test_a_save_that_outlasts_requeue_after_s_is_overtaken_by_the_requeue_and_last_stays_valid(sample, tmp_path):
    """The save at step 6 takes far longer than the warning allows: rank 0 requeues requeue_after_s after
    the signal anyway, SLURM then kills the job mid-save, and last.ckpt is still step 4's, complete."""
    root = tmp_path / "run"
    args = fit_args(sample, root, "--save_on_signal.check_every_n_steps", "1", "--save_on_signal.requeue_after_s", "1",
                    "--trainer.callbacks+=tests.checkpoint.preemption_callbacks.SignalAt", "--trainer.callbacks.step", "6",
                    "--trainer.callbacks+=tests.checkpoint.preemption_callbacks.HoldSaveAt", "--trainer.callbacks.step", "6")  # fmt: skip
    returncodes, logs, scontrol = run_slurm_job(args, tmp_path, kill_wait_s="0")

    assert returncodes == [-9, -9], logs[0][-3000:]  # killed by the stand-in SLURM, mid-save
    assert scontrol == f"requeue {JOB_ID}\n"
    assert "has not finished after save_on_signal.requeue_after_s = 1 s: requeueing now" in logs[0], logs[0][-3000:]
    assert last_step(root) == 4  # read() checks every shard file and meta.json
    assert checkpoint_names(root) == ["last.ckpt", "step=4.ckpt"]


class _SignalsItself(torch.utils.data.Dataset):
    """Item 0 is fetched by a worker that first sends itself SIGTERM and SIGUSR1: a sender other than its
    rank, as slurmstepd or torchrun's agent are. A signal a process sends itself is delivered before
    kill() returns, so a worker that does not ignore them is gone before item 0 comes back."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> tuple[int, int]:
        if index == 0:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGUSR1)
        return index, os.getpid()


def test_a_loader_worker_ignores_preemption_signals_from_others_and_ends_when_its_rank_ends_it():
    loader = DataLoader(_SignalsItself(), batch_size=None, num_workers=1, persistent_workers=True,
                        worker_init_fn=ignore_preemption_signals)  # fmt: skip
    batches = iter(loader)
    served = [next(batches) for _ in range(4)]
    worker = batches._workers[0]
    assert [tuple(item) for item in served] == [(i, worker.pid) for i in range(4)] and worker.is_alive()
    worker.terminate()  # SIGTERM from its rank, as multiprocessing sends it at exit
    worker.join(timeout=30)
    assert worker.exitcode == 0


def test_a_rank_with_live_persistent_workers_exits():
    # At exit multiprocessing terminates the workers with SIGTERM and joins them: a worker that ignored
    # every SIGTERM would hold its rank forever (a persistent train loader is alive at exit whenever a
    # run ends mid-epoch, as a pre-empted one does).
    script = (
        "from torch.utils.data import DataLoader\n"
        "from app.data.loader import ignore_preemption_signals\n"
        "loader = DataLoader(range(8), batch_size=None, num_workers=1, persistent_workers=True,\n"
        "                    worker_init_fn=ignore_preemption_signals)\n"
        "batches = iter(loader)\n"
        "print(next(batches))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path.cwd())}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 0 and result.stdout == "0\n", result.stderr[-2000:]


def test_requeue_calls_scontrol_with_the_job_id(tmp_path, monkeypatch):
    from app.checkpoint.preemption import requeue_slurm_job

    # scontrol itself exists only on a SLURM cluster: a stand-in on PATH records how it was called.
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / 'called'}\n")
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    assert requeue_slurm_job() == 0
    assert (tmp_path / "called").read_text() == "requeue 4242\n"
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "77")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    assert requeue_slurm_job() == 0
    assert (tmp_path / "called").read_text() == "requeue 77_3\n"


def test_requeue_without_scontrol_warns_and_reports_it(tmp_path, monkeypatch):
    from app.checkpoint.preemption import SCONTROL_MISSING, requeue_slurm_job

    monkeypatch.setenv("PATH", str(tmp_path))  # a container without SLURM's tools: no scontrol anywhere
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    with pytest.warns(UserWarning, match="scontrol is not on PATH here: SLURM job 4242 was not requeued"):
        assert requeue_slurm_job() == SCONTROL_MISSING
