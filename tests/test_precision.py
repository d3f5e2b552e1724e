"""The default trainer.precision: bf16 autocast on a CPU with bf16 matrix units, float32 elsewhere; a set value wins."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from jsonargparse import Namespace

from app import cli
from app.train import precision


def _cpu_with(monkeypatch, amx: bool, avx512_bf16: bool) -> None:
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)


@pytest.mark.parametrize(
    ("amx", "avx512_bf16", "units", "expected"),
    [(True, True, "amx_bf16", "bf16-mixed"), (False, True, "avx512_bf16", "bf16-mixed"), (False, False, None, None)],
)
def test_cpus_with_bf16_matrix_units_default_to_bf16_autocast(monkeypatch, amx, avx512_bf16, units, expected):
    _cpu_with(monkeypatch, amx, avx512_bf16)
    assert precision.cpu_bf16_units() == units
    chosen, why = precision.default_precision("cpu")
    assert chosen == expected
    assert (units or "no bf16 matrix units") in why


def test_gpus_keep_lightnings_default(monkeypatch):
    _cpu_with(monkeypatch, True, True)
    assert precision.default_precision("gpu")[0] is None
    assert precision.default_precision("cuda")[0] is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert precision.default_precision("auto")[0] is None  # auto picks the GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert precision.default_precision("auto")[0] == "bf16-mixed"
    assert precision.default_precision(None)[0] == "bf16-mixed"


@pytest.mark.parametrize("given", ["32-true", "bf16-mixed"])
def test_a_precision_the_user_sets_is_kept(monkeypatch, given):
    _cpu_with(monkeypatch, given == "32-true", False)  # the opposite of what the default would be
    trainer = Namespace(precision=given, accelerator="cpu")
    cli._choose_precision(trainer)
    assert trainer.precision == given


def test_fit_records_the_chosen_precision_in_its_config(tmp_path, sample_dir):
    # The real command line, one process: the saved config.yaml holds what the run trained with.
    args = ["fit", "--config", "configs/demo.yaml", "--trainer.devices", "1", "--trainer.max_steps", "2",
            "--data.train", str(sample_dir / "train.tsv"), "--data.val", "null", "--data.test", "null",
            "--data.predict", "null", "--data.cache_dir", str(tmp_path / "cache"), "--early_stopping.monitor", "null",
            "--checkpoint.monitor", "null", "--trainer.default_root_dir", str(tmp_path / "run")]  # fmt: skip
    finished = subprocess.run([sys.executable, "-m", "app", *args], capture_output=True, text=True, timeout=300,
                              cwd=Path(__file__).resolve().parents[1])  # fmt: skip
    assert finished.returncode == 0, finished.stderr[-3000:]
    expected, why = precision.default_precision("cpu")
    assert f"trainer.precision unset: {expected or '32-true'} ({why})" in finished.stdout + finished.stderr
    (saved,) = (tmp_path / "run").rglob("config.yaml")
    assert yaml.safe_load(saved.read_text())["trainer"]["precision"] == expected
