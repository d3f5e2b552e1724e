"""A checkpoint folder that cannot be written: refused before the first step of a fit, and a save into a
folder turned read-only mid-run stops every rank with the same line, the previous checkpoint intact.

The folder is made immutable (``chattr +i``): the tests run as root, whom permission bits do not stop."""

from __future__ import annotations

import os
import pickle
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torchrec.distributed.types import ShardingPlan

from app.checkpoint import format as checkpoint_format
from app.checkpoint.run_checkpoint import unwritable_folder
from app.cli import cli_main
from tests.checkpoint.test_checkpoint_format import OneProcess, lightning_dict, load_weights
from tests.multiprocess import rendezvous_port, run_folder


@contextmanager
def immutable(folder: Path):
    """``folder`` refuses new entries, even to root, until the block ends."""
    made = subprocess.run(["chattr", "+i", str(folder)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"chattr +i is not available here: {made.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)


def test_a_checkpoint_folder_is_writable_when_a_file_can_be_created_in_it(tmp_path):
    assert unwritable_folder(tmp_path / "checkpoints") is None  # made, written, nothing left in it
    assert list((tmp_path / "checkpoints").iterdir()) == []
    with immutable(tmp_path / "checkpoints") as folder:
        assert unwritable_folder(folder) == (
            f"checkpoint folder {folder} is not writable (Operation not permitted): set a writable checkpoint.dirpath"
        )


def test_a_fit_into_a_checkpoint_folder_it_cannot_write_stops_before_training(sample_dir, tmp_path, capsys):
    root = tmp_path / "run"
    (root / "checkpoints").mkdir(parents=True)
    args = ["fit", "--config", "configs/demo.yaml", "--data.train", str(sample_dir / "train.tsv"), "--data.val", "null",
            "--trainer.devices", "1", "--trainer.max_steps", "1", "--trainer.default_root_dir", str(root)]  # fmt: skip
    with immutable(root / "checkpoints"), pytest.raises(SystemExit) as stopped:
        cli_main(args)
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "Traceback" not in err
    assert f"error: checkpoint folder {root / 'checkpoints'} is not writable (Operation not permitted)" in err
    assert list((root / "checkpoints").iterdir()) == []


def test_a_save_into_a_folder_turned_read_only_names_it_and_keeps_the_previous_checkpoint(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    checkpoint_format.save(lightning_dict(model, 1), tmp_path / "last.ckpt", OneProcess(), ShardingPlan({}), 1)
    with immutable(tmp_path), pytest.raises(checkpoint_format.CheckpointNotWritableError) as refused:
        checkpoint_format.save(lightning_dict(model, 2), tmp_path / "last.ckpt", OneProcess(), ShardingPlan({}), 1)
    line = str(refused.value)  # the new folder's name ends with a random token
    assert line.startswith(f"checkpoint folder {tmp_path} is not writable (Operation not permitted: {tmp_path}/.last.ckpt.")
    assert line.endswith(f"); the newest checkpoint there, {tmp_path}/last.ckpt, is intact")
    assert load_weights(tmp_path / "last.ckpt", model)["meta"]["global_step"] == 1


class Gloo:
    """The collectives of format.save over the default gloo group."""

    is_global_zero = property(lambda self: dist.get_rank() == 0)
    checkpoint_process_group = None

    def broadcast(self, obj, src=0):
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def barrier(self, name=None):
        dist.barrier()


def _save_on_rank(rank: int, port: int, folder: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        checkpoint = lightning_dict(nn.Linear(3, 2), 2)
        checkpoint_format.save(checkpoint, Path(folder, "last.ckpt"), Gloo(), ShardingPlan({}), world_size=2)
        outcome = "saved"
    except checkpoint_format.CheckpointNotWritableError as error:
        outcome = str(error)
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps(outcome))


def test_every_rank_stops_with_the_same_line_when_rank_0_cannot_write(tmp_path):
    folder, out = run_folder(tmp_path, "checkpoints"), run_folder(tmp_path, "outcomes")
    with immutable(folder), rendezvous_port() as port:
        mp.start_processes(_save_on_rank, args=(port, str(folder), str(out)), nprocs=2, start_method="forkserver")
    outcomes = [pickle.loads((out / f"rank{rank}.pkl").read_bytes()) for rank in range(2)]
    assert outcomes[0] == outcomes[1]
    assert outcomes[0].startswith(f"checkpoint folder {folder} is not writable (Operation not permitted")
    assert outcomes[0].endswith("no checkpoint was saved there before")
