"""Shared fixtures: a small synthetic Criteo sample, and the real rows in ../shared when present."""

from __future__ import annotations

import atexit
import gc
import os
from pathlib import Path

import pytest

from app.data.synthetic import write_synthetic_criteo

SHARED_CRITEO = Path(__file__).resolve().parents[2] / "shared" / "data" / "criteo"

# As `python -m app` does (app/__main__.py): a test process's exit skips the last garbage collection over the
# objects torch, Lightning and TorchRec made (~1.5 s of CPU per worker, at the end of the suite).
atexit.register(gc.freeze)

# What Lightning's cluster environments and the strategy export into the process that runs the app.
_LAUNCHER_VARIABLES = (
    "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "GLOBAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"
)  # fmt: skip


# The files that take longest (several multi-process runs or an AOTInductor compile each), longest first.
# `make test` hands whole files to its workers in collection order (pytest-xdist's loadfile without its
# reordering, which would sort files by test count and leave these few-test, long files for last); taking
# them first keeps one long file from running alone at the end while the other workers idle.
LONGEST_FILES_FIRST = (
    "tests/cli/test_train.py", "tests/project/test_journeys.py", "tests/distributed/test_cluster.py",
    "tests/checkpoint/test_checkpoint_runs.py", "tests/bench/test_bench.py", "tests/checkpoint/test_run_folder.py",
    "tests/train/test_pipeline.py", "tests/checkpoint/test_preemption.py", "tests/quality/test_quality_bench.py",
    "tests/serve/test_export_pt2.py", "tests/data/test_vocabulary_coverage.py", "tests/train/test_early_stopping.py",
    "tests/bench/test_quality_guard.py", "tests/checkpoint/test_saved_model.py", "tests/checkpoint/test_resume.py",
    "tests/checkpoint/test_run_lock.py", "tests/model/test_model.py", "tests/distributed/test_job_lifetime.py",
)  # fmt: skip


def pytest_collection_modifyitems(config, items):
    """Runs LONGEST_FILES_FIRST's files first, in that order; the rest keep their order (a stable sort
    keeps each file's tests together and in order)."""
    rank = {name: at for at, name in enumerate(LONGEST_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


@pytest.fixture(autouse=True, scope="module")
def _no_process_group_left_to_the_next_file():
    """A test that runs the app inside pytest leaves Lightning's default process group initialised (Lightning
    does not destroy it at teardown); a later file of the same worker that makes its own would be refused
    ("trying to initialize the default process group twice")."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _restore_launcher_variables():
    """A test that runs the app inside pytest leaves MASTER_PORT & co. set here while its rendezvous
    store still holds that port; app processes of later tests would inherit it (EADDRINUSE)."""
    saved = {name: os.environ.get(name) for name in _LAUNCHER_VARIABLES}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="session")
def sample_dir(tmp_path_factory) -> Path:
    """train.tsv (4,096 rows), val.tsv (1,024 rows), predict.tsv (100 unlabelled) from the generator."""
    folder = tmp_path_factory.mktemp("synthetic")
    write_synthetic_criteo(folder / "train.tsv", num_rows=4_096, seed=101)
    write_synthetic_criteo(folder / "val.tsv", num_rows=1_024, seed=102)
    write_synthetic_criteo(folder / "predict.tsv", num_rows=100, seed=103, labelled=False)
    return folder


@pytest.fixture(scope="session")
def shared_criteo() -> Path:
    """The real Criteo rows in ../shared/data/criteo; the test is skipped where that folder is absent."""
    if not SHARED_CRITEO.is_dir():
        pytest.skip(f"real Criteo rows not found at {SHARED_CRITEO} (a clone without ../shared)")
    return SHARED_CRITEO


@pytest.fixture(scope="session")
def sample(tmp_path_factory) -> dict[str, Path]:
    """A tiny split for multi-process equivalence tests: 1,536 training rows (12 global batches of
    128) and 300 validation rows."""
    folder = tmp_path_factory.mktemp("sample")
    write_synthetic_criteo(folder / "train.tsv", num_rows=1_536, seed=11)
    write_synthetic_criteo(folder / "val.tsv", num_rows=300, seed=12)
    return {"train": folder / "train.tsv", "val": folder / "val.tsv"}


@pytest.fixture(scope="session")
def checkpoint_writer(sample, tmp_path_factory) -> dict:
    """A 2-process run that saved sharded checkpoints at steps 8 and 16 (tests/reshard_runs.py)."""
    from tests.reshard_runs import run_writer

    return run_writer(sample, tmp_path_factory.mktemp("writer"))
