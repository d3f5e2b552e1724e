"""Data specs -> files: a file, a glob pattern, a directory of data files, or a list of those,
expanded in natural order (``day_2`` before ``day_10``)."""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Sequence
from pathlib import Path

# File name endings a data directory is searched for.
DATA_SUFFIXES = (".tsv", ".txt", ".gz")  # .gz covers .tsv.gz and .txt.gz


def expand_paths(spec: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    """Resolve a data spec into a list of files.

    ``spec`` is a file, a glob pattern, a directory (its ``*.tsv``, ``*.txt`` and ``*.gz`` files,
    e.g. ``day_0.gz`` or ``train.txt.gz``) or a list of those (expanded in order). The files of a
    directory or a pattern come in natural order, so ``day_2`` precedes ``day_10`` (the Terabyte
    days are in time order). Raises FileNotFoundError naming the spec when something matches
    nothing.
    """
    items = [spec] if isinstance(spec, (str, os.PathLike)) else list(spec)
    if not items:
        raise FileNotFoundError("no data files given: the list of paths is empty")
    files: list[Path] = []
    for item in items:
        files.extend(_expand_one(item))
    return files


def _expand_one(item: str | os.PathLike) -> list[Path]:
    text = os.path.expanduser(os.fspath(item))
    path = Path(text)
    if path.is_dir():
        found = [p for p in path.iterdir() if p.name.endswith(DATA_SUFFIXES) and p.is_file()]
        if not found:
            raise FileNotFoundError(
                f"data directory {text!r} contains no *.tsv or *.txt files (plain or .gz)"
            )
        return sorted(found, key=_natural_key)
    if path.is_file():
        return [path]
    if glob.has_magic(text):
        found = [Path(p) for p in glob.glob(text, recursive=True) if os.path.isfile(p)]
        if not found:
            raise FileNotFoundError(f"no data files match the pattern {text!r}")
        return sorted(found, key=_natural_key)
    raise FileNotFoundError(f"data file or directory {text!r} does not exist")


def _natural_key(path: Path) -> tuple[list[str | int], str]:
    """Sort key comparing digit runs as numbers: ``day_2`` < ``day_10``.

    Splitting on a captured digit group alternates text and digits from the first element on, so
    two keys always compare str with str and int with int. The full text breaks ties (``01``/``1``).
    """
    text = str(path)
    pieces = re.split(r"(\d+)", text)
    return [int(piece) if i % 2 else piece for i, piece in enumerate(pieces)], text
