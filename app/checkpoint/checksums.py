"""Checksums of a checkpoint's files, so that a damaged shard stops a load instead of being trained on.

Sizes alone catch a truncated copy, not bit rot or a bad disk block: the CRC-32 of every shard file
(``__<rank>_<n>.distcp``) and of DCP's ``.metadata`` index is recorded in the checkpoint's ``meta.json``
(``shard_checksums``), which rank 0 writes last. Every process that reads the checkpoint checks every
recorded file before any weight is used (once per process, unless the files change).
DCP has no checksum of its own; zlib's CRC-32 runs at about 2.2-2.6 GB/s on one core here, against
BLAKE2b's 0.64, and a checksum that must catch accidents, not forgeries, needs no more.
The checksums are computed as DCP writes (ChecksummingFileSystemWriter), not by reading every file back
after the save, which cost 0.46 of the save time of 666 MB of tables: each large write is hashed on a
second thread while DCP goes on writing and syncing the file to disk. Each rank's checksums reach rank 0
with the write results DCP gathers there anyway, so no rank writes or syncs a file of its own for them
and no collective is added (the cost: docs/checkpoints.md).
A folder written before checksums existed records none and is read unchecked; one written when each rank
recorded its own (``checksums.<rank>.json``) is checked from those.
"""

from __future__ import annotations

import io
import json
import os
import zlib
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult

CHECKSUM_FILE = "checksums.{rank}.json"  # each rank's own record, in checkpoints of earlier versions of the app
_BLOCK_BYTES = 4 << 20
_STREAM_BUFFER_BYTES = 1 << 20
_verified: set[tuple] = set()  # (folder, its files' names, sizes and times) this process has checked


class DamagedCheckpointError(ValueError):
    """A file of a checkpoint does not hold the bytes its checksum records."""


def file_crc32(path: Path) -> str:
    """The CRC-32 of ``path``'s bytes, as 8 hex digits, read in blocks (bounded memory)."""
    crc = 0
    with open(path, "rb") as file:
        while block := file.read(_BLOCK_BYTES):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


class ChecksummingFileSystemWriter(dcp.FileSystemWriter):
    """DCP's FileSystemWriter that also computes the CRC-32 of every file it writes; after ``dcp.save``,
    ``recorded`` holds those of every rank's files on the coordinator (rank 0), None on the other ranks.
    The files hold the same bytes as DCP's own writer writes.

    Done by hand: DCP's only stream hook (the experimental ``_extensions`` of its writer) records each
    transform in the ``.metadata`` index and needs it registered again to read the checkpoint, which
    changes the stored format; hashing under the file stream DCP writes through changes nothing on disk."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        self.fs = _ChecksummingFileSystem()
        self.recorded: dict[str, dict[str, Any]] | None = None

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> torch.futures.Future[list[WriteResult]]:
        """DCP's writes, whose results (gathered on the coordinator for ``finish``) also carry this rank's
        checksums, as one extra entry that ``finish`` takes out before DCP's own ``finish`` sees them."""
        results = super().write_data(plan, planner).wait()  # DCP's writer returns it completed
        sums = {name: self._trusted(name, checksum) for name, checksum in self.fs.checksums.items()}
        carried: torch.futures.Future[list[WriteResult]] = torch.futures.Future()
        carried.set_result([*results, _RankChecksums(sums)])
        return carried

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        recorded: dict[str, dict[str, Any]] = {}
        for rank_results in results:
            for result in rank_results:
                if isinstance(result, _RankChecksums):
                    recorded.update(result.checksums)
        dcp_results = [[r for r in rank_results if not isinstance(r, _RankChecksums)] for rank_results in results]
        self.fs.checksums.clear()
        super().finish(metadata, dcp_results)  # writes the index, hashed as the shards were
        recorded.update((name, self._trusted(name, checksum)) for name, checksum in self.fs.checksums.items())
        self.recorded = dict(sorted(recorded.items()))

    def _trusted(self, name: str, checksum: dict[str, Any]) -> dict[str, Any]:
        """``checksum`` of the file ``name``, or, where the stream was rewound while writing (DCP does not
        do this), the file read back."""
        if checksum["bytes"] >= 0:
            return checksum
        path = Path(self.path) / name
        return {"crc32": file_crc32(path), "bytes": path.stat().st_size}


@dataclass
class _RankChecksums:
    """One rank's files' checksums, riding with its WriteResults to the coordinator."""

    checksums: dict[str, dict[str, Any]]


class _ChecksummingFileSystem(FileSystem):
    def __init__(self) -> None:
        super().__init__()
        self.checksums: dict[str, dict[str, Any]] = {}  # one writing thread per file: no lock needed

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        # A buffered stream, as Path.open gives DCP, over a raw file that hashes what reaches it: DCP's
        # torch.save makes about a hundred small writes per tensor, gathered here into 1 MiB writes
        # without a Python call each (a hashing stream above the buffer cost 14 % of the save time of a
        # demo checkpoint). A larger write passes through but for its last MiB, copied into the buffer.
        # A hashing thread of the file's own, started at its first large write (a pool kept across saves
        # would be inherited broken by a forked process: its threads gone, its queue waiting for them).
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-crc32") as hashing_thread:
            raw = _HashingFile(path, hashing_thread)
            with io.BufferedWriter(raw, buffer_size=_STREAM_BUFFER_BYTES) as stream:
                yield stream
        self.checksums[Path(path).name] = raw.checksum()

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)  # DCP writes .metadata as .metadata.tmp, then renames it
        if (checksum := self.checksums.pop(Path(path).name, None)) is not None:
            self.checksums[Path(new_path).name] = checksum


class _HashingFile(io.RawIOBase):
    """A file opened for writing whose bytes are hashed, in order, on the hashing thread, read back from
    the page cache right after each write: the thread keeps up while a core is free, and catches up
    during DCP's fsync (the disk's time, not the processor's) when none is; the file is closed once it has
    (hashing the caller's buffer instead would make every write wait for the hash)."""

    def __init__(self, path: str | os.PathLike, hashing_threads: ThreadPoolExecutor) -> None:
        super().__init__()
        self._file = io.FileIO(path, "w+")  # readable too: the hashing thread reads back what was written
        self._hashing_threads = hashing_threads  # one thread: the pieces are hashed in the order written
        self._hashed: list[Future] = []
        self._crc = 0
        self._bytes = 0  # the file is closed before its checksum is asked for: counted, not told
        self._rewound = False  # after a seek the running CRC would describe other bytes than the file's

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")[:_BLOCK_BYTES]  # the buffered stream above writes the rest next
        written = self._file.write(view)
        if written < _BLOCK_BYTES and (not self._hashed or self._hashed[-1].done()):
            # Nothing queued (the one thread hashes in order): a small write is hashed here, which costs
            # less than handing it to the thread: the two threads take turns at the interpreter's lock, and
            # on a busy machine the thread waits for a core (a demo checkpoint's save took 30-70 % longer
            # with every write of 16 KiB or more hashed there, 11 % with all of them hashed during DCP's fsync).
            self._crc = zlib.crc32(view[:written], self._crc)
        else:
            self._hashed.append(self._hashing_threads.submit(self._hash_written, self._bytes, written))
        self._bytes += written
        return written

    def _hash_written(self, offset: int, length: int) -> None:
        piece = os.pread(self._file.fileno(), length, offset)
        if len(piece) != length:
            raise OSError(f"{self._file.name}: read back {len(piece)} of the {length} bytes written at {offset}")
        self._crc = zlib.crc32(piece, self._crc)

    def tell(self) -> int:
        return self._file.tell()

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self._rewound = True
        return self._file.seek(offset, whence)

    def fileno(self) -> int:
        return self._file.fileno()

    def close(self) -> None:
        if not self.closed:
            super().close()  # flushes nothing of its own: the buffered stream above has written all
            try:
                for hashed in self._hashed:
                    hashed.result()
            finally:
                self._file.close()

    def checksum(self) -> dict[str, Any]:
        """``{"crc32", "bytes"}`` of what was written; bytes -1 if it cannot be trusted (a seek)."""
        return {"crc32": f"{self._crc:08x}", "bytes": -1 if self._rewound else self._bytes}


def verify_checksums(path: str | os.PathLike, folder: Path, recorded: dict[str, dict[str, Any]] | None) -> None:
    """Raises DamagedCheckpointError naming the checkpoint and the file when a recorded file's bytes
    differ from its checksum: those ``recorded`` in meta.json, or those of each rank's ``checksums.<rank>.json``
    in a folder written that way; a folder that records none (an older checkpoint) passes unchecked."""
    state = (str(folder), *sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir() if p.is_file()))
    if state in _verified:  # the CLI's pre-launch read, then the strategy's load: checked once
        return
    sums = dict(recorded or {})
    for record in sorted(folder.glob(CHECKSUM_FILE.format(rank="*"))):
        try:
            sums.update(json.loads(record.read_text()))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise DamagedCheckpointError(f"ckpt_path {path}: {record.name} is damaged (not the JSON it was written as)") from None
    for name, expected in sorted(sums.items()):
        _verify_file(path, folder / name, expected)
    _verified.add(state)


def _verify_file(path: str | os.PathLike, file: Path, expected: dict[str, object]) -> None:
    if not file.is_file():
        raise DamagedCheckpointError(f"ckpt_path {path}: shard file {file.name} is missing (incomplete copy?)")
    found = file_crc32(file)
    if found != expected["crc32"]:
        raise DamagedCheckpointError(
            f"ckpt_path {path}: shard file {file.name} is damaged (CRC-32 {found}, written as {expected['crc32']})"
        )
