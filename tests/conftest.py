"""Shared fixtures: a small synthetic Criteo sample, and the real rows in ../shared when present."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.data.synthetic import write_synthetic_criteo

SHARED_CRITEO = Path(__file__).resolve().parents[2] / "shared" / "data" / "criteo"


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
    from reshard_runs import run_writer

    return run_writer(sample, tmp_path_factory.mktemp("writer"))
