"""Files written whole or not at all: each is written under a temporary name (:func:`partial_path`:
``<name>.partial-<host>-<pid>``) and renamed when complete, so a file under its final name is
finished, and two writers (two nodes converting into one shared folder) never write into one file.
JSON, ``.npz`` sidecars (and reading their info back), ``.npy`` arrays, and ``.npy`` files streamed
chunk by chunk (:class:`NpyStreamWriter`)."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import socket
from pathlib import Path
from typing import Any

import numpy as np

PARTIAL = ".partial"


def partial_path(path: Path) -> Path:
    """Where this process writes ``path`` before renaming it into place: a name of its own (host and
    pid), so that another process writing the same file writes another one."""
    host = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname())
    return Path(f"{path}{PARTIAL}-{host}-{os.getpid()}")


def is_partial(path: Path) -> bool:
    """Whether ``path`` is a file still being written (or left half-written by a writer that died)."""
    return PARTIAL in Path(path).name


class NpyStreamWriter:
    """A .npy file written chunk by chunk under its :func:`partial_path`; ``commit`` renames it.

    The header is written for zero rows first and rewritten with the real count at the end: NumPy
    pads headers so that the first dimension can grow to 21 digits in place.
    """

    def __init__(self, path: Path, dtype: np.dtype, row_shape: tuple[int, ...]) -> None:
        self.path = path
        self.partial = partial_path(path)
        self.dtype = np.dtype(dtype)
        self.row_shape = row_shape
        self.rows = 0
        self._file = open(self.partial, "wb")
        self._header_bytes = self._file.write(self._header(0))

    def _header(self, rows: int) -> bytes:
        header = io.BytesIO()
        descr = np.lib.format.dtype_to_descr(self.dtype)
        fields = {"descr": descr, "fortran_order": False, "shape": (rows, *self.row_shape)}
        np.lib.format.write_array_header_1_0(header, fields)
        return header.getvalue()

    def write(self, rows: np.ndarray) -> None:
        """Append rows of shape (n, *row_shape), converted to the file's dtype."""
        rows = np.ascontiguousarray(rows, dtype=self.dtype).reshape(-1, *self.row_shape)
        if rows.size:  # (a memoryview of zero rows cannot be cast to bytes)
            self._file.write(memoryview(rows).cast("B"))
        self.rows += rows.shape[0]

    def finish(self) -> None:
        """Write the final header and close the file (still under its partial name)."""
        header = self._header(self.rows)
        if len(header) != self._header_bytes:  # cannot happen below 10**21 rows; never write a corrupt file
            raise RuntimeError(f"{self.partial}: the .npy header changed length; cannot patch it in place")
        self._file.seek(0)
        self._file.write(header)
        self._file.close()

    def commit(self) -> None:
        os.replace(self.partial, self.path)

    def abort(self) -> None:
        self._file.close()
        self.partial.unlink(missing_ok=True)


def read_sidecar_info(path: Path) -> dict[str, Any]:
    """The info dict of a day's stats or id-counts sidecar."""
    with np.load(path, allow_pickle=False) as sidecar:
        return json.loads(sidecar["info"].item())


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: missing") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None


def write_json_atomically(path: Path, value: dict[str, Any]) -> None:
    partial = partial_path(path)
    partial.write_text(json.dumps(value, indent=2, default=str) + "\n")
    os.replace(partial, path)


def save_npz_atomically(path: Path, **arrays: np.ndarray) -> None:
    partial = partial_path(path)
    with open(partial, "wb") as file:  # np.savez appends ".npz" to a file name, not to an open file
        np.savez(file, **arrays)
    os.replace(partial, path)


def link_or_copy(source: Path, target: Path) -> None:
    """``target`` as a hard link to ``source`` (no bytes copied), or a copy where the file system
    refuses (another device, no hard links). Only for files never rewritten in place."""
    target.unlink(missing_ok=True)
    try:
        os.link(source, target)
    except OSError:
        partial = partial_path(target)
        shutil.copyfile(source, partial)
        os.replace(partial, target)


def save_npy_atomically(path: Path, array: np.ndarray) -> None:
    partial = partial_path(path)
    with open(partial, "wb") as file:
        np.lib.format.write_array(file, array, allow_pickle=False)
    os.replace(partial, path)
