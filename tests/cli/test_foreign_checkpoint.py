"""A ``--ckpt_path`` that is not a checkpoint of this app gets the app's one-line error, before Lightning
or ``torch.load`` touch it: no traceback, no hint to load it with ``weights_only=False``, and nothing in
it runs."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch

from app.cli import cli_main


class _WritesAMarker:
    """A malicious pickle: unpickling it would create the file ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _foreign_files(folder: Path) -> dict[str, Path]:
    random_bytes = folder / "random.bin"
    random_bytes.write_bytes(bytes(range(256)) * 16)
    malicious = folder / "malicious.ckpt"
    malicious.write_bytes(pickle.dumps({"state_dict": _WritesAMarker(folder / "marker")}))
    torch_save = folder / "other.pt"
    torch.save({"weights": torch.ones(3)}, torch_save)
    empty_folder = folder / "some_folder"
    empty_folder.mkdir()
    return {"random": random_bytes, "malicious pickle": malicious, "torch.save": torch_save, "folder": empty_folder}


def _exit_code(args: list[str]) -> int:
    try:
        cli_main(args)
    except SystemExit as exit_info:
        return exit_info.code
    return 0


@pytest.mark.parametrize("subcommand", ["fit", "validate", "predict"])
def test_a_foreign_ckpt_path_gets_one_line_and_runs_nothing(subcommand, sample_dir, tmp_path, capsys):
    data = ["--data.train", str(sample_dir / "train.tsv"), "--data.val", str(sample_dir / "val.tsv")]
    data += ["--data.test", "null", "--data.predict", str(sample_dir / "predict.tsv")]
    for kind, path in _foreign_files(tmp_path).items():
        args = [subcommand, "--config", "configs/demo.yaml", *data, "--trainer.default_root_dir", str(tmp_path / "runs")]
        assert _exit_code(args + ["--ckpt_path", str(path)]) == 2, kind
        err = capsys.readouterr().err
        assert f"error: ckpt_path {path}" in err, (kind, err)
        assert "Traceback" not in err and "weights_only" not in err, (kind, err)
    assert not (tmp_path / "marker").exists(), "the malicious pickle ran"
