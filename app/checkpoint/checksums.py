"""Checksums of a checkpoint's files, so that a damaged shard stops a load instead of being trained on.

Sizes alone catch a truncated copy, not bit rot or a bad disk block: each rank records the CRC-32 of the
shard files it wrote (``__<rank>_<n>.distcp``; rank 0 also DCP's ``.metadata`` index) in
``checksums.<rank>.json`` beside them, before ``meta.json`` marks the folder complete. Every process that
reads the checkpoint checks every recorded file before any weight is used (once per process, unless
the files change).
DCP has no checksum of its own; zlib's CRC-32 runs at about 2.6 GB/s on one core here, against
BLAKE2b's 0.64, and a checksum that must catch accidents, not forgeries, needs no more.
The checksums are computed as DCP writes (ChecksummingFileSystemWriter), not by reading every file back
after the save, which cost 0.46 of the save time of 666 MB of tables: each large write is hashed on a
second thread while DCP goes on writing and syncing the file to disk (the cost: docs/checkpoints.md).
A folder written before checksums existed has no such file and is read unchecked.
"""

from __future__ import annotations

import io
import json
import os
import zlib
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem

CHECKSUM_FILE = "checksums.{rank}.json"
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
    """DCP's FileSystemWriter that also computes the CRC-32 of every file it writes (``checksums()``);
    the files hold the same bytes as DCP's own writer writes.

    Done by hand: DCP's only stream hook (the experimental ``_extensions`` of its writer) records each
    transform in the ``.metadata`` index and needs it registered again to read the checkpoint, which
    changes the stored format; hashing under the file stream DCP writes through changes nothing on disk."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        self.fs = _ChecksummingFileSystem()

    def checksums(self) -> dict[str, dict[str, Any]]:
        """``{"crc32", "bytes"}`` of each file this writer finished writing, by name."""
        self.fs.hashing_threads.shutdown()
        return dict(self.fs.checksums)


class _ChecksummingFileSystem(FileSystem):
    def __init__(self) -> None:
        super().__init__()
        self.checksums: dict[str, dict[str, Any]] = {}  # one writing thread per file: no lock needed
        # This writer's own thread, started on first use: a pool shared across saves would be inherited
        # broken by a forked process (its threads gone, its queue waiting for them).
        self.hashing_threads = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-crc32")

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
        raw = _HashingFile(path, self.hashing_threads)
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
            # less than waking the thread (a demo checkpoint's save took 30 % longer that way).
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


def write_rank_checksums(folder: Path, rank: int, written: dict[str, dict[str, Any]] | None = None) -> None:
    """Records the checksums of the shard files ``rank`` wrote into ``folder`` (and, on rank 0, DCP's index):
    those ``written`` computed while writing (a ChecksummingFileSystemWriter's), any other by reading it."""
    names = sorted(path.name for path in folder.glob(f"__{rank}_*.distcp"))
    if rank == 0 and (folder / ".metadata").is_file():
        names.append(".metadata")
    written = written or {}
    sums = {}
    for name in names:
        size = (folder / name).stat().st_size
        known = written.get(name)
        if known is None or known["bytes"] != size:  # it reached the disk another way: read it back
            known = {"crc32": file_crc32(folder / name), "bytes": size}
        sums[name] = known
    temporary = folder / (CHECKSUM_FILE.format(rank=rank) + ".tmp")
    temporary.write_text(json.dumps(sums, indent=1) + "\n")
    os.replace(temporary, folder / CHECKSUM_FILE.format(rank=rank))


def verify_checksums(path: str | os.PathLike, folder: Path) -> None:
    """Raises DamagedCheckpointError naming the checkpoint and the file when a recorded file's bytes
    differ from its checksum; a folder without checksum files (an older checkpoint) passes unchecked."""
    state = (str(folder), *sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir() if p.is_file()))
    if state in _verified:  # the CLI's pre-launch read, then the strategy's load: checked once
        return
    for record in sorted(folder.glob(CHECKSUM_FILE.format(rank="*"))):
        try:
            sums = json.loads(record.read_text())
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
