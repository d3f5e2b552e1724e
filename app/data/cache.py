"""The cache of raw TSV converted to NumPy day files: where it is, whether it can be reused, and
making it (with :mod:`app.data.preprocess`, once, in parallel, resumable).

Raw Criteo text is parsed once per input set, not once per run and rank: ``fit``, ``validate`` and
``test`` read the cached days memory-mapped, so host memory per rank stays bounded whatever the
data size (docs/data.md). One input set (a split's files) is one folder
``<cache_dir>/<name>-<hash of the input paths>``, holding the preprocessor's ``day_N_*.npy`` and
``metadata.json`` and this module's ``cache.json``:

* ``fingerprint``: the inputs (absolute path, size, modification time) and the options that shape
  the days (dense transform, bad-row handling, the preprocessor's format version). A cache whose
  fingerprint differs from the run's is stale: it is deleted and made again, never read.
* ``complete``: written ``true`` last, once every day and ``metadata.json`` are in place. A folder
  without it was left by a killed or failed conversion: the next conversion resumes it (finished
  days are kept, see :mod:`app.data.preprocess.resume`).
* ``error``: why the last conversion failed, so that ranks that did not convert (they wait at the
  strategy's barrier while one rank per node, or one in all, converts) stop with the same message instead of waiting.

A lock file (``<folder>.lock``, :mod:`app.data.lock_file`: safe on storage shared by many hosts,
naming its holder) makes concurrent conversions of one folder (several nodes of a job whose cache is
on shared storage, several jobs) take turns: the first converts, the others wait for it (up to
``wait_s``) and then find it done; one that waits longer stops with one line naming the folder and
the holder. A holder that is gone (its process ended on this host, or its SLURM job was requeued) is
taken over, and the files it left half-written are deleted before the conversion resumes.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.data.lock_file import HolderLock
from app.data.preprocess import FORMAT_VERSION, Config, default_workers
from app.data.preprocess import run as preprocess
from app.data.preprocess.files import is_partial, partial_path

CACHE_FILE = "cache.json"
DEFAULT_CACHE_FOLDER = "criteo_cache"  # beside the raw data unless data.cache_dir says otherwise
# How long a conversion waits for another process converting the same folder, unless told: longer
# than converting Kaggle or a Terabyte day takes, and bounded, so that a holder gone on another host
# (which cannot be probed from here) ends in a message instead of a hang.
DEFAULT_WAIT_S = 3600.0
LOCK_POLL_S = 1.0  # between looks at another converter's lock file


@dataclass(frozen=True)
class CacheRequest:
    """One input set to cache: its raw files (in day order) and the options that shape its days."""

    inputs: tuple[Path, ...]
    dense_transform: str
    on_bad_rows: str
    cache_dir: Path | None = None  # None: DEFAULT_CACHE_FOLDER beside the first input
    workers: int | None = None  # conversion processes (and threads); None: the cores here
    wait_s: float = DEFAULT_WAIT_S  # for another process converting the same folder
    parquet_schema: dict[str, Any] | None = None  # Parquet inputs: their feature schema; None: raw TSV

    @property
    def folder(self) -> Path:
        """Where the days of this input set are cached."""
        first = self.inputs[0].resolve()
        root = self.cache_dir if self.cache_dir is not None else first.parent / DEFAULT_CACHE_FOLDER
        paths = "\n".join(str(p.resolve()) for p in self.inputs)
        digest = hashlib.sha256(paths.encode()).hexdigest()[:12]
        name = first.name.split(".")[0] + (f"_and_{len(self.inputs) - 1}_more" if len(self.inputs) > 1 else "")
        return Path(root).expanduser() / f"{name}-{digest}"

    def fingerprint(self) -> dict[str, Any]:
        """What the cached days depend on: equal fingerprints, equal days."""
        inputs = []
        for path in self.inputs:
            stat = path.stat()
            inputs.append({"path": str(path.resolve()), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns})
        return {
            "format_version": FORMAT_VERSION,
            "dense_transform": self.dense_transform,
            "on_bad_rows": self.on_bad_rows,
            "inputs": inputs,
        } | ({"parquet_schema": self.parquet_schema} if self.parquet_schema is not None else {})


def cached_days(request: CacheRequest, convert: bool = True) -> Path:
    """The folder of ``request``'s cached days, converted first if needed (and ``convert``).

    Without ``convert`` (ranks that wait while another converts), a folder that is not complete
    raises the error recorded by the failed conversion, or says it is missing.
    """
    return cached_folder(request.folder, request.fingerprint(), lambda folder: _convert(request, folder), convert, request.wait_s)


def cached_folder(
    folder: Path,
    fingerprint: dict[str, Any],
    make: Callable[[Path], None],
    convert: bool = True,
    wait_s: float = DEFAULT_WAIT_S,
) -> Path:
    """``folder``, made by ``make(folder)`` first unless it is complete with this ``fingerprint``: the
    cache's protocol (``cache.json``, the lock, stale folders replaced, failures recorded) for any
    folder derived from others (the converted days, a vocabulary, days mapped with it).

    ``make`` may find the files of an unfinished earlier attempt with the same fingerprint there;
    a folder made from another fingerprint is deleted first. Without ``convert`` the folder is only
    read (no lock: ``cache.json`` is replaced whole). ``wait_s``: how long to wait for another
    process converting it.
    """
    if _is_complete(folder, fingerprint):
        return folder
    if not convert:
        state = _read_state(folder)
        recorded = state.get("error") if state.get("fingerprint") == fingerprint else None
        converter = "local rank 0 of each node, or global rank 0 under data.prepare_data_per_node false"
        unfinished = f"the rank converting it ({converter}) did not finish"
        raise ValueError(
            f"data cache {folder} is not complete: " + (f"its conversion failed: {recorded}" if recorded else unfinished)
        )
    _make_parent(folder)
    lock = _hold(folder, wait_s, lambda: _is_complete(folder, fingerprint))
    if lock is None:
        return folder  # another process converted it while this one waited
    try:
        state = _read_state(folder)
        if state.get("fingerprint") == fingerprint and state.get("complete"):
            return folder  # another process converted it while this one waited
        _make(folder, fingerprint, state, make)
    finally:
        lock.release()
    return folder


def _hold(folder: Path, wait_s: float, done: Callable[[], bool]) -> HolderLock | None:
    """The lock of ``folder``, waiting up to ``wait_s`` for a live holder (another node or job converting);
    None once the folder is ``done`` meanwhile (many waiting ranks then need not take the lock in turn)."""
    lock = HolderLock(Path(f"{folder}.lock"))
    deadline = time.monotonic() + wait_s
    holder = lock.acquire()
    if holder is not None:
        print(f"data cache {folder}: waiting up to {wait_s:g} s for {holder.describe()}, which is converting it", file=sys.stderr)
    while holder is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ValueError(
                f"data cache {folder} is being converted by {holder.describe()}; waited {wait_s:g} s: let it finish, "
                f"or if that process is gone delete {lock.path}; or set data.cache_dir to convert elsewhere"
            )
        time.sleep(min(LOCK_POLL_S, left))  # another process's file: nothing to wait on but the file itself
        if done():
            return None
        holder = lock.acquire()
    if lock.replaced is not None:
        print(f"data cache {folder}: took the lock over from {lock.replaced.describe()} (gone)", file=sys.stderr)
    return lock


def _is_complete(folder: Path, fingerprint: dict[str, Any]) -> bool:
    state = _read_state(folder)
    return bool(state.get("complete")) and state.get("fingerprint") == fingerprint


def _read_state(folder: Path) -> dict[str, Any]:
    try:
        return json.loads((folder / CACHE_FILE).read_text())
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return {}


def _write_state(folder: Path, state: dict[str, Any]) -> None:
    partial = partial_path(folder / CACHE_FILE)
    partial.write_text(json.dumps(state, indent=2) + "\n")
    os.replace(partial, folder / CACHE_FILE)


def _make_parent(folder: Path) -> None:
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"cannot create the data cache folder {folder.parent} ({error}); set data.cache_dir") from None


def _make(folder: Path, fingerprint: dict[str, Any], state: dict[str, Any], make: Callable[[Path], None]) -> None:
    """Make (or finish making) ``folder`` with ``make``, recording the outcome."""
    if folder.exists() and state.get("fingerprint") != fingerprint:
        why = "other inputs or options" if state else "an unknown run"
        print(f"data cache {folder} was made from {why}: converting again", file=sys.stderr)
        shutil.rmtree(folder)
    elif state.get("error"):
        print(f"data cache {folder}: the last conversion failed ({state['error']}); converting again", file=sys.stderr)
    elif folder.exists():
        print(f"data cache {folder}: resuming an unfinished conversion", file=sys.stderr)
    if folder.exists():  # this process holds the lock: a half-written file here is a gone writer's
        for leftover in folder.iterdir():
            if is_partial(leftover):
                leftover.unlink()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _write_state(folder, {"fingerprint": fingerprint, "complete": False, "error": None})
        make(folder)
        _write_state(folder, {"fingerprint": fingerprint, "complete": True, "error": None})
    except OSError as error:
        if error.errno != errno.ENOSPC:
            _record_failure(folder, fingerprint, error)
            raise
        full = ValueError(
            f"no space left on the disk holding the data cache {folder}: free some, or set data.cache_dir to a "
            "folder with room (the cache takes 160 bytes per row, about 2/3 of the raw text)"
        )
        _record_failure(folder, fingerprint, full)
        raise full from None
    except BaseException as error:
        _record_failure(folder, fingerprint, error)
        raise


def _convert(request: CacheRequest, folder: Path) -> None:
    """Raw TSV -> NumPy days in ``folder``, by the preprocessor (which resumes finished days)."""
    workers = request.workers if request.workers is not None else default_workers()
    config = Config(
        inputs=[str(p) for p in request.inputs],
        output=folder,
        workers=workers,
        dense_transform=request.dense_transform,
        on_bad_rows=request.on_bad_rows,
        progress=sys.stderr.isatty(),
        parquet_schema=request.parquet_schema,
    )
    preprocess(config)


def _record_failure(folder: Path, fingerprint: dict[str, Any], error: BaseException) -> None:
    try:
        _write_state(folder, {"fingerprint": fingerprint, "complete": False, "error": str(error) or type(error).__name__})
    except OSError:
        pass  # a full disk may refuse even this; the waiting ranks then say the conversion did not finish


def read_metadata(folder: Path) -> dict[str, Any]:
    """The preprocessor's ``metadata.json`` of a folder of days (rows, skipped rows, distinct ids)."""
    path = folder / "metadata.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: missing; the folder was not written by app.data.preprocess") from None
