"""A checkpoint proves it is intact: every rank records its shards' CRC-32, every reader checks them
before any weight is used, and ``--ckpt_path last`` falls back to the newest intact checkpoint."""

from __future__ import annotations

import json
import shutil
import struct
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.utils.serialization import config as serialization_config

from app.bench.checkpoint_save import demo_state, measure_dcp
from app.checkpoint.checksums import ChecksummingFileSystemWriter, DamagedCheckpointError, crc32_combine, file_crc32
from app.checkpoint.format import CHECKSUMS_KEY, META_FILE
from app.checkpoint.format import read as read_checkpoint
from app.checkpoint.run_folder import last_checkpoint
from app.cli import cli_main
from tests.reshard_runs import eval_args

FLIPPED_BYTES = 4096


def _copy_checkpoints(checkpoint_writer, tmp_path: Path) -> Path:
    """The writer run's checkpoints (step=8, step=16) copied as plain folders, with ``last.ckpt`` = step 16."""
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    for name in ("step=8.ckpt", "step=16.ckpt"):  # oldest first: their times order them as the run did
        shutil.copytree(checkpoint_writer["root"] / "checkpoints" / name, folder / name, symlinks=False)
    shutil.copytree(folder / "step=16.ckpt", folder / "last.ckpt")
    return folder


def _flip(shard: Path) -> None:
    """Inverts 4 KiB in the middle of ``shard`` without changing its size."""
    data = bytearray(shard.read_bytes())
    middle = len(data) // 2
    data[middle : middle + FLIPPED_BYTES] = bytes(b ^ 0xFF for b in data[middle : middle + FLIPPED_BYTES])
    shard.write_bytes(bytes(data))


def test_every_ranks_shards_are_recorded_in_meta_json_and_an_intact_copy_reads(checkpoint_writer, tmp_path):
    folder = _copy_checkpoints(checkpoint_writer, tmp_path) / "step=16.ckpt"
    recorded = json.loads((folder / META_FILE).read_text())[CHECKSUMS_KEY]
    assert sorted(recorded) == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # both ranks' shards reach rank 0
    for name, checksum in recorded.items():
        assert checksum == {"crc32": file_crc32(folder / name), "bytes": (folder / name).stat().st_size}
    assert not list(folder.glob("checksums.*.json"))  # no file of their own on any rank
    read_checkpoint(folder)  # no error


def test_a_flipped_shard_is_refused_naming_it_and_last_falls_back(checkpoint_writer, sample, tmp_path, capsys):
    folder = _copy_checkpoints(checkpoint_writer, tmp_path)
    _flip(folder / "last.ckpt" / "__1_0.distcp")
    with pytest.raises(DamagedCheckpointError, match=r"last.ckpt: shard file __1_0.distcp is damaged"):
        read_checkpoint(folder / "last.ckpt")
    # The CLI reads the checkpoint before any worker starts: one line, no traceback.
    args = eval_args(sample, tmp_path / "eval", "validate", 2, folder / "last.ckpt", [])
    with pytest.raises(SystemExit) as exit_info:
        cli_main(args)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "shard file __1_0.distcp is damaged" in err and "Traceback" not in err
    with pytest.warns(UserWarning, match=r"is damaged.*; last falls back to .*step=16.ckpt, the newest intact"):
        assert last_checkpoint(str(folder), fitting=True) == str(folder / "step=16.ckpt")
    _flip(folder / "step=16.ckpt" / "__0_0.distcp")
    with pytest.warns(UserWarning, match=r"last falls back to .*step=8.ckpt"):
        assert last_checkpoint(str(folder), fitting=True) == str(folder / "step=8.ckpt")
    _flip(folder / "step=8.ckpt" / ".metadata")
    with pytest.raises(FileNotFoundError, match="no other checkpoint in .* is intact"):
        last_checkpoint(str(folder), fitting=False)


@pytest.mark.parametrize("torch_computes_crc32", [True, False], ids=["torch_crc32", "torch_crc32_off"])
@pytest.mark.parametrize(
    "state",
    [  # tables whose CRC-32 torch.save writes after them (one over several 4 MiB writes, one of exactly 1 MiB), a
        # pickled object; small tensors gathered by the stream's buffer
        {"table": torch.randn(10_000, 128, generator=torch.Generator().manual_seed(0)), "bias": torch.zeros(7),
         "exactly_1_mib": torch.ones(262_144), "object": {"ids": list(range(200_000))}},
        {f"layer_{i}": torch.full((10, 4), float(i)) for i in range(20)},
    ],
    ids=["large_tensors", "small_tensors"],
)  # fmt: skip
def test_the_checksums_computed_during_the_save_are_those_of_the_files_written(state, torch_computes_crc32, tmp_path):
    # With torch's own CRC-32 turned off the records' bytes are hashed as written instead.
    saved = serialization_config.save.compute_crc32
    serialization_config.save.compute_crc32 = torch_computes_crc32
    try:
        _check_the_checksums_of_a_save(state, tmp_path)
    finally:
        serialization_config.save.compute_crc32 = saved


def test_the_crc32_of_two_parts_combines_to_that_of_the_whole():
    first, second = bytes(range(256)) * 5, bytes(reversed(range(256))) * 4_099
    for a, b in [(first, second), (b"", second), (first, b""), (b"x", b"y")]:
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


_RECORD_BYTES = 2 << 20  # one write of a tensor's bytes, large enough that its CRC is taken from what follows it


@pytest.mark.parametrize(
    "after_the_record",
    [  # what the file holds after a stored zip record with a data descriptor, when it ends
        struct.pack("<IIII", 0x08074B50, zlib.crc32(b"\x07" * _RECORD_BYTES), _RECORD_BYTES, _RECORD_BYTES),
        b"PK\x07\x08tail",  # a cut descriptor: the record is read back
        b"",
    ],
    ids=["zip_descriptor_then_end", "cut_descriptor", "nothing"],
)
def test_a_file_that_ends_within_a_records_descriptor_gets_the_crc32_of_its_bytes(after_the_record, tmp_path):
    name = b"archive/data/0"
    local_header = struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 1 << 3, 0, 0, 0, 0, 0, 0, len(name), 0) + name
    writer = ChecksummingFileSystemWriter(tmp_path)
    with writer.fs.create_stream(tmp_path / "file", "wb") as stream:
        for piece in (local_header, b"\x07" * _RECORD_BYTES, after_the_record):
            stream.write(piece)
    written = (tmp_path / "file").read_bytes()
    assert writer.fs.checksums["file"] == {"crc32": f"{zlib.crc32(written):08x}", "bytes": len(written)}


def _check_the_checksums_of_a_save(state: dict, tmp_path: Path) -> None:
    writer = ChecksummingFileSystemWriter(tmp_path / "checkpoint")
    dcp.save(state, storage_writer=writer)
    computed = writer.recorded
    files = sorted(path.name for path in (tmp_path / "checkpoint").iterdir())
    assert sorted(computed) == files == [".metadata", "__0_0.distcp"]
    for name in files:
        path = tmp_path / "checkpoint" / name
        assert computed[name] == {"crc32": file_crc32(path), "bytes": path.stat().st_size}
    # DCP's own writer writes the same shard bytes, and the same index of them.
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path / "plain"))
    assert (tmp_path / "checkpoint" / "__0_0.distcp").read_bytes() == (tmp_path / "plain" / "__0_0.distcp").read_bytes()
    indexes = [dcp.FileSystemReader(tmp_path / name).read_metadata() for name in ("checkpoint", "plain")]
    assert indexes[0].storage_data == indexes[1].storage_data
    assert indexes[0].state_dict_metadata == indexes[1].state_dict_metadata


def test_the_save_bench_times_both_writers_alternately_on_a_checkpoints_tensors(checkpoint_writer, tmp_path):
    checkpoint = checkpoint_writer["root"] / "checkpoints" / "step=16.ckpt"
    state = demo_state(checkpoint)  # the checkpoint's tensors by name, shape and type, every rank's shards as one
    index = read_checkpoint(checkpoint).index.state_dict_metadata
    assert {name: list(tensor.shape) for name, tensor in state.items()} == {
        name: list(entry.size) for name, entry in index.items() if hasattr(entry, "size")
    }
    result = measure_dcp("test", state, tmp_path, repeats=2)
    assert result["repeats"] == [2, 2] and result["plain_ms"]["median"] > 0 and result["checksums_ms"]["median"] > 0
    assert not list(tmp_path.iterdir())  # every save removed
