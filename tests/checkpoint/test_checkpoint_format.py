"""The checkpoint format on its own (one process): plain-data metadata, publishing that survives a
crash in the middle of a save, and a clear message for each kind of bad checkpoint."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torchrec.distributed.types import ShardingPlan

from app.checkpoint import format as checkpoint_format


class OneProcess:
    """The collectives of a run with a single process: it is rank 0, and there is nobody to wait for."""

    is_global_zero = True
    checkpoint_process_group = None  # DCP's default: no process group in a single process

    def broadcast(self, obj, src=0):
        return obj

    def barrier(self, name=None):
        pass


def lightning_dict(model: nn.Module, step: int) -> dict:
    """What Lightning hands the strategy: tensors of the model plus loops and callbacks' plain state."""
    return {
        "epoch": 0,
        "global_step": step,
        "state_dict": {k: v.clone() for k, v in model.state_dict().items()},
        "loops": {"fit_loop": {"state_dict": {"combined_loader": [{"epoch": 0, "next_batch": step}]}}},
        "callbacks": {"ModelCheckpoint{'monitor': 'val/auc'}": {"best_model_score": torch.tensor(0.75),
                                                                "best_k_models": {"a.ckpt": torch.tensor(0.75)}}},
        "hyper_parameters": {"embedding_dim": 8, "layers": [16, 8]},
    }  # fmt: skip


def save(model: nn.Module, path: Path, step: int) -> None:
    checkpoint_format.save(lightning_dict(model, step), path, OneProcess(), ShardingPlan({}), world_size=1)


def load_weights(path: Path, model: nn.Module) -> dict:
    info = checkpoint_format.read(path, model)
    state = {"state_dict": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    dcp.load(state, storage_reader=checkpoint_format.SafeFileSystemReader(info.path))
    return {"meta": info.meta, **state["state_dict"]}


@pytest.fixture
def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(3, 2)


def test_metadata_is_json_and_comes_back_with_its_tensors(model, tmp_path):
    save(model, tmp_path / "last.ckpt", step=7)
    text = (tmp_path / "last.ckpt" / "meta.json").read_text()
    meta = json.loads(text)  # plain JSON: no pickle anywhere in it
    assert meta["world_size"] == 1 and meta["tensor_keys"] == ["state_dict"]
    loaded = load_weights(tmp_path / "last.ckpt", model)
    callback = loaded["meta"]["callbacks"]["ModelCheckpoint{'monitor': 'val/auc'}"]
    assert callback["best_model_score"].dtype == torch.float32 and callback["best_model_score"].item() == 0.75
    assert loaded["meta"]["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"epoch": 0, "next_batch": 7}]
    assert torch.equal(loaded["weight"], model.weight) and torch.equal(loaded["bias"], model.bias)


def test_replacing_last_swaps_a_link_and_removes_the_old_folder(model, tmp_path):
    save(model, tmp_path / "last.ckpt", step=1)
    first = os.readlink(tmp_path / "last.ckpt")
    save(model, tmp_path / "last.ckpt", step=2)
    second = os.readlink(tmp_path / "last.ckpt")
    assert first != second
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([second, "last.ckpt"])
    assert load_weights(tmp_path / "last.ckpt", model)["meta"]["global_step"] == 2


@pytest.mark.parametrize("fault", ["shard_writer", "metadata_writer"])
def test_a_crash_during_a_save_leaves_the_previous_last_loadable(fault, model, tmp_path, monkeypatch):
    save(model, tmp_path / "last.ckpt", step=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.add_(1.0)

    def crash(*args, **kwargs):
        raise OSError("disk full (injected)")

    if fault == "shard_writer":
        monkeypatch.setattr(dcp.FileSystemWriter, "write_data", crash)
    else:
        monkeypatch.setattr(checkpoint_format, "_write_file_durably", crash)
    with pytest.raises(BaseException) as error:  # DCP's CheckpointException is a BaseException
        save(model, tmp_path / "last.ckpt", step=2)
    assert "disk full (injected)" in str(error.value)  # DCP wraps the writer's error with each rank's traceback
    monkeypatch.undo()

    loaded = load_weights(tmp_path / "last.ckpt", model)
    assert loaded["meta"]["global_step"] == 1
    assert torch.equal(loaded["weight"], before["weight"])
    # The next save succeeds and sweeps away the half-written folder.
    save(model, tmp_path / "last.ckpt", step=3)
    assert len([p for p in tmp_path.iterdir() if p.name.startswith(".last.ckpt.")]) == 1


def break_checkpoint(source: Path, target: Path, how: str) -> Path:
    shutil.copytree(source, target, symlinks=False)  # a plain copy of the folder, as `cp -rL` makes
    if how == "missing_shard":
        (target / "__0_0.distcp").unlink()
    elif how == "truncated_shard":
        data = (target / "__0_0.distcp").read_bytes()
        (target / "__0_0.distcp").write_bytes(data[: len(data) // 2])
    elif how == "truncated_meta":
        text = (target / "meta.json").read_text()
        (target / "meta.json").write_text(text[: len(text) // 2])
    elif how == "truncated_index":
        data = (target / ".metadata").read_bytes()
        (target / ".metadata").write_bytes(data[: len(data) // 2])
    elif how == "not_a_checkpoint":
        (target / "meta.json").unlink()
    return target


@pytest.mark.parametrize(
    "how, message",
    [
        ("missing_shard", "shard file __0_0.distcp is missing"),
        ("truncated_shard", "shard file __0_0.distcp is truncated"),
        ("truncated_meta", "meta.json is truncated or corrupted"),
        ("truncated_index", ".metadata (the shard index) is unreadable"),
        ("not_a_checkpoint", "not a complete checkpoint of this app (a folder without meta.json)"),
    ],
)
def test_a_broken_checkpoint_is_named_with_what_is_wrong(how, message, model, tmp_path):
    save(model, tmp_path / "last.ckpt", step=1)
    broken = break_checkpoint(tmp_path / "last.ckpt", tmp_path / "broken", how)
    with pytest.raises(ValueError) as error:
        checkpoint_format.read(broken, model)
    assert str(error.value).startswith(f"ckpt_path {broken}: {message}")


def test_a_missing_path_and_a_model_of_other_shape_are_named(model, tmp_path):
    with pytest.raises(ValueError, match=f"ckpt_path {tmp_path / 'nope.ckpt'}: no such checkpoint"):
        checkpoint_format.read(tmp_path / "nope.ckpt", model)
    save(model, tmp_path / "last.ckpt", step=1)
    with pytest.raises(ValueError) as error:
        checkpoint_format.read(tmp_path / "last.ckpt", nn.Linear(4, 2))
    assert str(error.value) == (
        f"ckpt_path {tmp_path / 'last.ckpt'} does not fit this model: weight is [2, 3] there, [2, 4] here"
    )


def test_an_index_that_names_other_code_is_refused(model, tmp_path):
    save(model, tmp_path / "last.ckpt", step=1)
    # A pickle that would call os.system when unpickled with pickle.load.
    evil = b"cos\nsystem\n(S'echo owned'\ntR."
    (tmp_path / "last.ckpt" / ".metadata").write_bytes(evil)
    with pytest.raises(ValueError, match=r"unreadable \(os.system is not allowed in a checkpoint index\)"):
        checkpoint_format.read(tmp_path / "last.ckpt", model)


def test_an_old_checkpoint_folder_that_cannot_be_removed_is_left_for_the_next_save(tmp_path, monkeypatch):
    # NFS keeps a file that another client holds open as .nfsXXXX, and rmtree of its folder fails with
    # "Directory not empty" (ENOTEMPTY) or "Device or resource busy" (EBUSY); simulated here, as this
    # machine has no NFS mount.
    link = tmp_path / "last.ckpt"
    old, new = tmp_path / ".last.ckpt.old", tmp_path / ".last.ckpt.new"
    old.mkdir()
    (old / ".nfs000001").write_text("held open elsewhere")
    new.mkdir()
    os.symlink(new.name, link)
    real_rmtree = checkpoint_format.shutil.rmtree

    def rmtree_on_nfs(path, *args, **kwargs):
        if any(p.name.startswith(".nfs") for p in Path(path).iterdir()):
            raise OSError(errno.ENOTEMPTY, "Directory not empty", str(path))
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(checkpoint_format.shutil, "rmtree", rmtree_on_nfs)
    with pytest.warns(UserWarning, match=r"could not remove the old checkpoint folder .*\.last\.ckpt\.old"):
        checkpoint_format._remove_unlinked_folders(link)
    assert old.exists() and new.exists()
    (old / ".nfs000001").unlink()  # the other client let go: the next save's pass removes the folder
    checkpoint_format._remove_unlinked_folders(link)
    assert not old.exists() and new.exists() and os.readlink(link) == new.name
