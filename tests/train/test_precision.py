"""The default trainer.precision: bf16 autocast on a CPU with bf16 matrix units, float32 elsewhere; a set value wins.

A real fit that records its choice: tests/cli/test_train.py (test_fit_records_the_precision_it_chose_when_none_was_set)."""

from __future__ import annotations

import pytest
import torch
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
