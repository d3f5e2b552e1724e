"""Checksums of a checkpoint's files, so that a damaged shard stops a load instead of being trained on.

Sizes alone catch a truncated copy, not bit rot or a bad disk block: the CRC-32 of every shard file
(``__<rank>_<n>.distcp``) and of DCP's ``.metadata`` index is recorded in the checkpoint's ``meta.json``
(``shard_checksums``), which rank 0 writes last. Every process that reads the checkpoint checks every
recorded file before any weight is used (once per process, unless the files change).
DCP has no checksum of its own; zlib's CRC-32 runs at about 2.2-2.6 GB/s on one core here, against
BLAKE2b's 0.64, and a checksum that must catch accidents, not forgeries, needs no more.
The checksums are computed as DCP writes (ChecksummingFileSystemWriter), not by reading every file back
after the save, which cost 0.46 of the save time of 666 MB of tables; and a large tensor's bytes are not
hashed at all: torch.save, which DCP writes each tensor with, already writes their CRC-32 after them (zip's
data descriptor), and the file's CRC-32 is combined from it (``crc32_combine``). Each rank's checksums reach
rank 0 with the write results DCP gathers there anyway, so no rank writes or syncs a file of its own for
them and no collective is added (the cost: docs/checkpoints.md).
A folder written before checksums existed records none and is read unchecked; one written when each rank
recorded its own (``checksums.<rank>.json``) is checked from those.
"""

from __future__ import annotations

import io
import json
import os
import struct
import zlib
from collections.abc import Iterator
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
_RECORD_MIN_BYTES = 1 << 20  # a smaller tensor is hashed as written: folding its CRC in costs about as much
_TAIL_BYTES = 1024  # the bytes before a record read for its local header: 30, its name, torch's alignment padding
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # signature, version, flags, method, time, date, crc, sizes, name, extra
_HAS_DATA_DESCRIPTOR = 1 << 3  # the record's CRC and sizes follow its bytes
_DESCRIPTOR_SIGNATURE = 0x08074B50
_DESCRIPTOR_BYTES = 24  # signature, CRC, and two sizes of 4 bytes (zip) or 8 (zip64)
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
        # demo checkpoint). A larger write (a tensor's bytes) passes through whole.
        raw = _HashingFile(path)
        with io.BufferedWriter(raw, buffer_size=_STREAM_BUFFER_BYTES) as stream:
            yield stream
        self.checksums[Path(path).name] = raw.checksum()

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)  # DCP writes .metadata as .metadata.tmp, then renames it
        if (checksum := self.checksums.pop(Path(path).name, None)) is not None:
            self.checksums[Path(new_path).name] = checksum


class _HashingFile(io.RawIOBase):
    """A file opened for writing that computes the CRC-32 of the bytes written, without hashing a large
    tensor's bytes a second time: DCP writes each tensor with torch.save, a zip archive whose record of the
    tensor's bytes is stored as is and followed by their CRC-32 (zip's data descriptor), which torch has
    computed anyway. A record of 1 MiB or more is skipped here, its CRC taken from the descriptor once it is
    written (checked against the record's length, else the record is read back and hashed) and combined
    into the file's (``crc32_combine``). Everything else is hashed as it is written, in line. (Hashing the
    large writes on a second thread instead, read back from the page cache, added 71 % to a 666 MB save on
    a busy 2-core machine, where the thread found no free core; small writes handed to it cost more still:
    the threads take turns at the interpreter's lock.)"""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__()
        self._file = io.FileIO(path, "w+")  # readable too: a record whose CRC cannot be taken is read back
        self._crc = 0  # of the bytes since the last skipped record's end (of the whole file outside one)
        self._bytes = 0  # the file is closed before its checksum is asked for: counted, not told
        self._record: _SkippedRecord | None = None
        self._after_record = b""  # the first bytes after a skipped record: its descriptor
        self._rewound = False  # after a seek the running CRC would describe other bytes than the file's

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if self._record is None and len(view) < _RECORD_MIN_BYTES:  # most writes: hashed as written
            written = self._file.write(view[:_BLOCK_BYTES])
            self._crc = zlib.crc32(view[:written], self._crc)
            self._bytes += written
            return written
        written = self._file.write(view[:_BLOCK_BYTES])  # the buffered stream above writes the rest next
        piece, offset = view[:written], self._bytes
        self._bytes += written
        if self._record is None:  # a write of 1 MiB or more: a tensor's bytes in a zip record?
            header = os.pread(self._file.fileno(), min(offset, _TAIL_BYTES), offset - min(offset, _TAIL_BYTES))
            self._record = _SkippedRecord.starting_at(offset, len(view), header, self._crc)
            if self._record is not None:
                self._crc = 0
        if self._record is not None and offset < self._record.end:
            piece = piece[self._record.end - offset :]  # the record's own bytes are not hashed
        if self._record is not None and len(self._after_record) < _DESCRIPTOR_BYTES:
            self._after_record += bytes(piece[: _DESCRIPTOR_BYTES - len(self._after_record)])
        self._crc = zlib.crc32(piece, self._crc)
        if self._record is not None and len(self._after_record) >= _DESCRIPTOR_BYTES:
            self._fold_the_record()
        return written

    def _fold_the_record(self) -> None:
        """The file's CRC with the skipped record's: from its descriptor, or by reading it back."""
        record, after = self._record, self._bytes - self._record.end
        record_crc = record.crc_from_descriptor(self._after_record)
        if record_crc is None:  # not the descriptor expected: hash the record's bytes from the file
            record_crc = 0
            for offset in range(record.start, record.end, _BLOCK_BYTES):
                length = min(_BLOCK_BYTES, record.end - offset)
                record_crc = zlib.crc32(os.pread(self._file.fileno(), length, offset), record_crc)
        crc = crc32_combine(record.crc_before, record_crc, record.end - record.start)
        self._crc = crc32_combine(crc, self._crc, after)
        self._record, self._after_record = None, b""

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
                if self._record is not None:  # the file ended within 24 bytes of the record: a zip descriptor
                    self._fold_the_record()  # of 16 bytes still gives its CRC, else the record is read back
            finally:
                self._file.close()

    def checksum(self) -> dict[str, Any]:
        """``{"crc32", "bytes"}`` of what was written; bytes -1 if it cannot be trusted (a seek)."""
        return {"crc32": f"{self._crc:08x}", "bytes": -1 if self._rewound else self._bytes}


@dataclass
class _SkippedRecord:
    """A zip record of a tensor's bytes, stored as is, that torch.save follows with their CRC-32."""

    start: int
    end: int
    crc_before: int  # the file's CRC-32 up to ``start``

    @classmethod
    def starting_at(cls, offset: int, length: int, tail: bytes, crc: int) -> _SkippedRecord | None:
        """The record whose bytes a write of ``length`` at ``offset`` begins, if ``tail`` (the bytes before
        it) ends with a zip local header of a stored record with a data descriptor, and torch computes CRCs."""
        at = tail.rfind(b"PK\x03\x04")
        if at < 0 or len(tail) - at < _LOCAL_HEADER.size or not _torch_writes_crc32():
            return None
        _, _, flags, method, _, _, _, _, _, name_bytes, extra_bytes = _LOCAL_HEADER.unpack_from(tail, at)
        ends_here = at + _LOCAL_HEADER.size + name_bytes + extra_bytes == len(tail)
        if not ends_here or method != 0 or not flags & _HAS_DATA_DESCRIPTOR:
            return None
        return cls(start=offset, end=offset + length, crc_before=crc)

    def crc_from_descriptor(self, descriptor: bytes) -> int | None:
        """The record's CRC-32 from the bytes written after it, if they are its descriptor (zip or zip64)."""
        if len(descriptor) < 16 or struct.unpack_from("<I", descriptor)[0] != _DESCRIPTOR_SIGNATURE:
            return None
        sizes = [struct.unpack_from("<II", descriptor, 8)]
        if len(descriptor) >= _DESCRIPTOR_BYTES:
            sizes.append(struct.unpack_from("<QQ", descriptor, 8))
        length = self.end - self.start
        return struct.unpack_from("<I", descriptor, 4)[0] if (length, length) in sizes else None


def _torch_writes_crc32() -> bool:
    """Whether torch.save computes its records' CRC-32 (a setting of torch's; on unless turned off)."""
    try:
        from torch.utils.serialization import config
    except ImportError:  # a torch without the setting always computes them
        return True
    return bool(getattr(config.save, "compute_crc32", True))


# CRC-32 of a concatenation from the parts' CRCs (zlib's crc32_combine, which Python's zlib does not offer):
# polynomials over GF(2), reflected, modulo the CRC-32 polynomial.
_CRC32_POLYNOMIAL = 0xEDB88320


def _multiply_modulo(a: int, b: int) -> int:
    m, product = 1 << 31, 0
    while m:
        if a & m:
            product ^= b
            if not a & (m - 1):
                break
        m >>= 1
        b = (b >> 1) ^ _CRC32_POLYNOMIAL if b & 1 else b >> 1
    return product


_X_TO_2_TO_THE = [1 << 30]  # x^(2^k) modulo the polynomial, k = 0..31
for _ in range(31):
    _X_TO_2_TO_THE.append(_multiply_modulo(_X_TO_2_TO_THE[-1], _X_TO_2_TO_THE[-1]))


def crc32_combine(crc_first: int, crc_second: int, second_bytes: int) -> int:
    """The CRC-32 of two byte strings one after the other, from their CRC-32s and the second's length."""
    power, k, n = 1 << 31, 3, second_bytes  # x^(8n): appending n zero bytes
    while n:
        if n & 1:
            power = _multiply_modulo(_X_TO_2_TO_THE[k & 31], power)
        n >>= 1
        k += 1
    return _multiply_modulo(power, crc_first) ^ crc_second


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
