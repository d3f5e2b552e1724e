"""Which Parquet files a data setting names: a file, a glob, a folder of ``*.parquet`` files, or a
list of those, in natural order (``part-2`` before ``part-10``)."""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence
from pathlib import Path

from app.data.paths import expand_paths

PARQUET_SUFFIX = ".parquet"


def is_parquet_input(path: Path) -> bool:
    """A ``.parquet`` file, or a folder holding one."""
    if path.is_dir():
        return any(p.name.endswith(PARQUET_SUFFIX) for p in path.iterdir())
    return path.name.endswith(PARQUET_SUFFIX)


def parquet_files(spec: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    """The files of ``spec`` (a folder gives its ``*.parquet`` files); FileNotFoundError naming what matched nothing."""
    items = [spec] if isinstance(spec, (str, os.PathLike)) else list(spec)
    if not items:
        raise FileNotFoundError("no data files given: the list of paths is empty")
    files: list[Path] = []
    for item in items:
        folder = Path(os.path.expanduser(os.fspath(item)))
        if folder.is_dir():
            if not is_parquet_input(folder):
                raise FileNotFoundError(f"data directory {str(folder)!r} contains no *{PARQUET_SUFFIX} files")
            files.extend(expand_paths(os.path.join(glob.escape(str(folder)), "*" + PARQUET_SUFFIX)))
        else:
            files.extend(expand_paths(item))
    return files
