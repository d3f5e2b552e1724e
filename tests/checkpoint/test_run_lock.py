"""One fit job at a time in a run folder (issue 19, item 5): the lock file naming its holder
(app/data/lock_file.py, app/checkpoint/run_lock.py), a second job refused with one line while the
first goes on unharmed, a requeued SLURM job or a holder gone on this host taken over, a holder on
another host refused with how to take over. "Hosts" and "jobs" are faked with the lock file's record
and SLURM_* variables; processes are real."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from lightning.pytorch import Callback, LightningModule, Trainer

from app.checkpoint import format as checkpoint_format
from app.checkpoint.run_lock import LOCK_FILE, RunFolderLock
from app.data.lock_file import Holder, HolderLock, read_holder
from tests.child_process import finish, read_until, tell
from tests.multiprocess import DEMO_BEFORE_QUALITY_SETTINGS

REPO = Path(__file__).resolve().parents[2]  # on PYTHONPATH: the test-only callbacks are tests.<group>.<module>.<Class>


class WaitForTheTest(Callback):
    """Test-only: at the start of training says READY on stdout and waits for a line on stdin, so that
    the test acts while this job holds its run folder (no sleeps, no timing)."""

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        print("READY", flush=True)
        sys.stdin.readline()


def record(path: Path, **fields) -> Holder:
    """Writes a lock file as another process would have left it: this process's record with ``fields`` changed."""
    holder = dataclasses.replace(Holder.of_this_process(), **fields)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dataclasses.asdict(holder)))
    return holder


@pytest.fixture
def live_process():
    """A process that runs until the test ends (it reads stdin to its end)."""
    process = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    yield process
    process.stdin.close()
    process.wait(timeout=60)


@pytest.fixture(autouse=True)
def _no_slurm(monkeypatch):
    for name in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)


def test_a_live_holder_here_is_refused_by_name_and_taken_over_once_it_is_gone(live_process, tmp_path):
    lock_path = tmp_path / "run" / LOCK_FILE
    holder = record(lock_path, pid=live_process.pid, pid_start_ticks=None, command="python -m app fit (the other)")
    refusal = RunFolderLock([tmp_path / "run"]).acquire()
    assert refusal == (
        f"run folder {tmp_path / 'run'} is in use by pid {live_process.pid} on {holder.host} since {holder.started} "
        f"(python -m app fit (the other)) (its lock file {lock_path}): two jobs in one run folder delete each other's "
        "checkpoints in progress and resume each other's; set another trainer.default_root_dir, or if that job has "
        f"ended (one on another host cannot be checked from here) delete {lock_path}"
    )
    assert read_holder(lock_path) == holder  # refused: the holder's file untouched
    live_process.stdin.close()
    live_process.wait(timeout=60)
    lock = RunFolderLock([tmp_path / "run"])
    assert lock.acquire() is None  # its process is gone: stale
    assert lock.taken_over() == [f"run folder {tmp_path / 'run'}: taken over from {holder.describe()}, which has ended"]
    assert read_holder(lock_path).pid == os.getpid()
    lock.release()
    assert not lock_path.exists()


def test_a_reused_pid_is_not_taken_for_the_holder(live_process, tmp_path):
    lock = HolderLock(tmp_path / LOCK_FILE)
    record(lock.path, pid=live_process.pid, pid_start_ticks=1)  # that pid's process started later: another one
    assert lock.acquire() is None and lock.replaced.pid == live_process.pid


def test_a_requeued_slurm_job_takes_over_its_lock_left_on_another_host(tmp_path, monkeypatch):
    lock = record(tmp_path / LOCK_FILE, host="node-before-requeue", pid=4321, slurm_job_id="777", slurm_restart_count=0)
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    taker = HolderLock(tmp_path / LOCK_FILE)
    assert taker.acquire() is None
    assert taker.replaced == lock
    now = read_holder(taker.path)
    assert (now.slurm_job_id, now.slurm_restart_count, now.pid) == ("777", 1, os.getpid())


@pytest.mark.parametrize("job, restarts", [("779", "1"), ("777", "0")], ids=["another_job", "another_step_of_the_job"])
def test_a_holder_on_another_host_is_refused_with_how_to_take_over(job, restarts, tmp_path, monkeypatch):
    lock_path = tmp_path / LOCK_FILE
    holder = record(lock_path, host="node-elsewhere", pid=4321, slurm_job_id="777", slurm_restart_count=0)
    monkeypatch.setenv("SLURM_JOB_ID", job)
    monkeypatch.setenv("SLURM_RESTART_COUNT", restarts)
    refusal = RunFolderLock([tmp_path]).acquire()
    assert refusal.startswith(f"run folder {tmp_path} is in use by SLURM job 777, pid 4321 on node-elsewhere since")
    assert refusal.endswith(f"or if that job has ended (one on another host cannot be checked from here) delete {lock_path}")
    assert read_holder(lock_path) == holder


def test_a_refused_folder_releases_the_folders_already_taken(tmp_path):
    record(tmp_path / "checkpoints" / LOCK_FILE, host="node-elsewhere", pid=4321)
    lock = RunFolderLock([tmp_path / "run", tmp_path / "checkpoints"])
    assert lock.acquire() is not None
    assert not (tmp_path / "run" / LOCK_FILE).exists()


def test_a_release_leaves_a_lock_that_was_taken_over_meanwhile(tmp_path):
    lock = HolderLock(tmp_path / LOCK_FILE)
    assert lock.acquire() is None and read_holder(lock.path).token == lock.me.token
    successor = record(lock.path, host="node-after-requeue", token="0123456789abcdef")
    assert read_holder(lock.path).token != lock.me.token
    lock.release()
    assert read_holder(lock.path) == successor


CONTENDER = """
import sys
from pathlib import Path
from app.data.lock_file import HolderLock
lock = HolderLock(Path(sys.argv[1]))
sys.stdin.readline()
print("held" if lock.acquire() is None else "refused", flush=True)
sys.stdin.readline()
"""


def test_of_processes_racing_for_a_free_lock_exactly_one_holds_it(tmp_path):
    contenders = [
        subprocess.Popen([sys.executable, "-c", CONTENDER, str(tmp_path / LOCK_FILE)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, cwd=REPO)
        for _ in range(4)
    ]  # fmt: skip
    for process in contenders:  # all started and waiting: let them go at once
        process.stdin.write("\n")
        process.stdin.flush()
    answers = [process.stdout.readline().strip() for process in contenders]
    for process in contenders:
        process.stdin.close()
        process.wait(timeout=60)
    assert sorted(answers) == ["held", "refused", "refused", "refused"]


# ---- two real jobs on one run folder -------------------------------------------------------------


def fit_args(sample: dict[str, Path], root: Path) -> list[str]:
    return [
        sys.executable, "-m", "app", "fit", "--config", "configs/demo.yaml", *DEMO_BEFORE_QUALITY_SETTINGS,
        "--data.train", str(sample["train"]), "--data.val", str(sample["val"]), "--data.test", "null",
        "--data.predict", "null", "--data.batch_size", "128", "--data.num_embeddings_per_feature", "500",
        "--data.cache_dir", str(root.parent / "cache"), "--model.embedding_dim", "8",
        "--model.dense_arch_layer_sizes", "[16, 8]", "--model.over_arch_layer_sizes", "[16, 1]",
        "--trainer.max_steps", "3", "--trainer.devices", "1", "--trainer.logger", "false",
        "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(root),
        "--trainer.callbacks+=tests.checkpoint.test_run_lock.WaitForTheTest",
    ]  # fmt: skip


def job(args: list[str], slurm_job_id: str, extra_env: dict[str, str] | None = None, **popen) -> subprocess.Popen:
    """A "job" of its own: its own process tree, its own fake SLURM job id (and ``extra_env``; not the
    variables that make Lightning see SLURM, so Lightning's launcher runs it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "APP_TRACEBACK"))}
    env.update(SLURM_JOB_ID=slurm_job_id, PYTHONPATH=str(REPO), **(extra_env or {}))
    return subprocess.Popen(args, env=env, cwd=REPO, text=True, **popen)


def test_a_second_job_on_a_run_folder_in_use_is_refused_and_the_first_finishes(sample, tmp_path):
    root = tmp_path / "run"
    first = job(fit_args(sample, root), "5001", stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        read_until(first.stdout, "READY")  # the first job trains (it holds the folder since start-up)
        code, _, err = finish(job(fit_args(sample, root), "5002", stdin=subprocess.DEVNULL, stderr=subprocess.PIPE))
        assert code == 2 and "Traceback" not in err, err[-3000:]
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(lines) == 1 and lines[0].startswith(
            f"error: run folder {root} is in use by SLURM job 5001, pid {first.pid} on "
        ), err[-3000:]
        tell(first)
        assert finish(first)[0] == 0
    finally:
        first.kill()
        first.wait()
    info = checkpoint_format.read(root / "checkpoints" / "last.ckpt")
    assert info.meta["global_step"] == 3  # the first job trained and saved as if alone
    assert not (root / LOCK_FILE).exists()  # given back at its end


# ---- what rank 0 deletes beside a checkpoint ----------------------------------------------------


def test_an_unfinished_checkpoint_folder_of_a_live_writer_here_is_left_alone(live_process, tmp_path):
    link = tmp_path / "last.ckpt"
    current, live, dead, elsewhere = (tmp_path / f".last.ckpt.{name}" for name in ("cur", "live", "dead", "other"))
    for folder in (current, live, dead, elsewhere):
        folder.mkdir()
    (current / checkpoint_format.META_FILE).write_text("{}")
    record(live / checkpoint_format.WRITER_FILE, pid=live_process.pid, pid_start_ticks=None)  # another job's save
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    record(dead / checkpoint_format.WRITER_FILE, pid=int(finished.stdout), pid_start_ticks=None)  # crashed save
    record(elsewhere / checkpoint_format.WRITER_FILE, host="node-elsewhere", pid=4321)  # cannot be probed
    os.symlink(current.name, link)
    checkpoint_format._remove_unlinked_folders(link)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["last.ckpt", current.name, live.name])


def test_a_requeued_job_takes_its_run_folder_over_from_its_earlier_run_on_another_host(sample, tmp_path):
    root = tmp_path / "run"
    earlier = record(root / LOCK_FILE, host="node-before-requeue", pid=4321, slurm_job_id="6001", slurm_restart_count=0)
    requeued = job(fit_args(sample, root), "6001", stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                   extra_env={"SLURM_RESTART_COUNT": "1"})  # fmt: skip
    code, out, _ = finish(requeued)
    assert code == 0, out[-3000:]
    assert f"run folder {root}: taken over from {earlier.describe()}, which has ended" in out
    assert checkpoint_format.read(root / "checkpoints" / "last.ckpt").meta["global_step"] == 3
    assert not (root / LOCK_FILE).exists()
