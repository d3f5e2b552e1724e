"""The pages' journeys run as written, in order, scaled down (as litgpt's tests/test_readme.py runs its
journeys): the README's quickstart and tour on a small sample, and docs/criteo-terabyte.md's steps on 24
synthetic Terabyte-format days, on CPU processes instead of GPUs. Each command is the page's own, with
settings appended that shrink it (later settings win)."""

from __future__ import annotations

import gzip
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from app.data.synthetic import write_synthetic_criteo

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300
# Small enough for seconds a command: 4 steps an epoch on 2 processes.
SMALL_DEMO = ["--data.batch_size", "64"]
# terabyte_dlrm.yaml's model and sharding on 2 CPU processes: tables of 1,000 rows, a narrow model.
SMALL_TERABYTE = [
    "--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.precision", "32-true",
    "--trainer.strategy.init_args.sharding_types", "[table_wise]", "--data.num_embeddings_per_feature", "1000",
    "--model.embedding_dim", "16", "--model.dense_arch_layer_sizes", "[32, 16]",
    "--model.over_arch_layer_sizes", "[32, 1]", "--model.auc_num_thresholds", "1000",
    "--data.batch_size", "32", "--data.num_workers", "0",
]


def shell_commands(page: Path, start: str = "", end: str | None = None) -> list[str]:
    """The commands of the page's bash blocks between the headings ``start`` and ``end``, continuation
    lines joined, comments dropped."""
    text = page.read_text()
    text = text[text.index(start) : text.index(end) if end else None]
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.M | re.S):
        lines = block.replace("\\\n", " ").splitlines()
        commands += [line.split("  #")[0].strip() for line in lines if line.strip() and not line.startswith("#")]
    return commands


def run(command: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=TIMEOUT_S, cwd=cwd, env=env)
    assert done.returncode == 0, f"{command}\n{done.stderr[-3000:]}"
    return done


def app_command(command: str, shrink: list[str]) -> str:
    """``python -m app...`` with the interpreter of the tests, torchrun's launch replaced by the app's own
    processes (``trainer.devices``), and ``shrink`` appended to the app's commands that train or score."""
    words = shlex.split(command)
    at = words.index("-m")
    args = words[at + 2 :]
    if words[at + 1] == "app" and args[0] in ("fit", "validate", "test", "predict"):
        args += shrink
    return shlex.join([sys.executable, "-m", words[at + 1], *args])


@pytest.fixture(scope="module")
def demo_clone(tmp_path_factory) -> Path:
    """A folder laid out like a clone after `make run`'s set-up: configs/ and a small data/sample/."""
    folder = tmp_path_factory.mktemp("clone")
    (folder / "configs").symlink_to(REPO / "configs")
    sample = folder / "data" / "sample"
    sample.mkdir(parents=True)
    write_synthetic_criteo(sample / "train.tsv", num_rows=512, seed=1)
    write_synthetic_criteo(sample / "val.tsv", num_rows=256, seed=2)
    write_synthetic_criteo(sample / "test.tsv", num_rows=256, seed=3)
    write_synthetic_criteo(sample / "predict.tsv", num_rows=50, seed=4, labelled=False)
    return folder


def test_the_readme_quickstart_and_tour_run_in_order(demo_clone):
    readme = REPO / "README.md"
    make_run = re.search(r"^run:.*\n\t\$\(PY\) (-m app .*)$", (REPO / "Makefile").read_text(), flags=re.M).group(1)
    tour = [c for c in shell_commands(readme, "## A five-minute tour", "**GPUs and many nodes.**") if "--help" not in c]
    resume = [c for c in shell_commands(readme, "**Resuming.**", "**Data and preprocessing.**")]
    assert "python -m app fit --config configs/demo.yaml --ckpt_path last" in resume
    for command in [f"python {make_run}", *tour, *resume]:
        run(app_command(command, SMALL_DEMO), demo_clone)
    runs = demo_clone / "runs"
    assert (runs / "demo" / "predictions.tsv").read_text().count("\n") == 51  # a header and 50 rows
    assert (runs / "demo" / "model.pt").is_file()
    assert {"demo", "demo-2", "demo-3", "demo-4"} <= {p.name for p in runs.iterdir()}


@pytest.fixture(scope="module")
def terabyte_days(tmp_path_factory) -> Path:
    """24 gzipped days of 192 synthetic rows each, named as Criteo publishes them, under data/criteo/terabyte."""
    folder = tmp_path_factory.mktemp("terabyte")
    days = folder / "data" / "criteo" / "terabyte"
    days.mkdir(parents=True)
    for day in range(24):
        write_synthetic_criteo(days / f"day_{day}", num_rows=192, seed=100 + day)
        (days / f"day_{day}.gz").write_bytes(gzip.compress((days / f"day_{day}").read_bytes()))
        if day != 23:
            (days / f"day_{day}").unlink()  # day 23 stays unpacked too: the page cuts rows to score from it
    (folder / "configs").symlink_to(REPO / "configs")
    return folder


def test_the_terabyte_tutorial_runs_scaled_down(terabyte_days):
    page = REPO / "docs" / "criteo-terabyte.md"
    commands = shell_commands(page, "## 1. Get the data")
    data = str(terabyte_days / "data")
    steps = {
        "preprocess": [c for c in commands if "app.data.preprocess" in c],
        "fit": [c for c in commands if " app fit " in c and "--checkpoint." not in c and "--ckpt_path" not in c][:1],
        "resume": [c for c in commands if " app fit " in c and "--ckpt_path last" in c],
        "validate": [c for c in commands if " app validate " in c],
        "export": [c for c in commands if " app export " in c],
        "cut": [c for c in commands if c.startswith("head ")],
        "predict": [c for c in commands if " app predict " in c],
    }
    assert all(len(found) == 1 for found in steps.values()), steps
    for name, (command,) in steps.items():
        command = command.replace("/data/", data + "/")
        if name == "preprocess":
            command += " --workers 2"
        if name == "fit":
            command += " --trainer.max_steps 3"  # a validation at step 3 (20 an epoch), then last.ckpt
        if name == "resume":
            command += " --trainer.max_steps 5"
        run(app_command(command, SMALL_TERABYTE) if " -m app" in command else command, terabyte_days)
    run_folder = Path(data) / "runs" / "terabyte"
    assert (run_folder / "model.pt").is_file()
    assert (run_folder / "predictions.tsv").read_text().count("\n") == 1 + 192
