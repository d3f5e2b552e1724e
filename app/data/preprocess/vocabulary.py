"""Vocabularies (``--frequency_threshold``, ``--vocabulary``, ``data.frequency_threshold``): the
counting pass that makes them (per file's id counts, merged one feature at a time, the ids seen >= T
times kept), choosing the one a run maps with, mapping raw ids to contiguous ids with it, and
:class:`Vocabulary`, one vocabulary as an object that travels (cache folder, checkpoint, export).

A vocabulary folder holds ``vocab_feature_0.npy`` .. ``vocab_feature_25.npy`` (each the sorted raw
ids kept for that feature, int64: 8 bytes per kept id) and ``vocabulary.json`` (threshold, sizes,
and the SHA-256 of the 26 arrays, which names the vocabulary wherever it travels).
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from app.criteo import NUM_SPARSE, SPARSE_NAMES
from app.data.preprocess.chunks import iter_chunks
from app.data.preprocess.config import Config, DayResult, DayTask
from app.data.preprocess.files import (
    link_or_copy,
    read_json,
    save_npy_atomically,
    save_npz_atomically,
    write_json_atomically,
)
from app.data.preprocess.id_counts import IdCounter
from app.data.preprocess.resume import counted_already, input_info
from app.data.preprocess.workers import report_rows, run_tasks

# Contiguous ids (TorchRec): 1 for rare or unseen ids, 2 for the first vocabulary entry.
RARE_ID = 1
FIRST_CONTIGUOUS_ID = 2
VOCABULARY_FILE = "vocabulary.json"
# Rows mapped at once: bounds the temporaries (a few times rows x 26 x 8 bytes) for any input size.
MAP_BLOCK_ROWS = 1 << 16


def vocabulary_path(folder: Path, feature: int) -> Path:
    return folder / f"vocab_feature_{feature}.npy"


def load_vocabularies(folder: Path) -> list[np.ndarray]:
    """The 26 sorted raw-id vocabularies saved in ``folder`` (memory-mapped)."""
    vocabularies = []
    for j in range(NUM_SPARSE):
        path = vocabulary_path(folder, j)
        if not path.is_file():
            raise FileNotFoundError(
                f"{path}: missing; a vocabulary folder holds vocab_feature_0.npy .. vocab_feature_25.npy"
            )
        vocabularies.append(np.load(path, mmap_mode="r"))
    return vocabularies


def map_to_contiguous(
    raw_ids: np.ndarray,
    vocabularies: Sequence[np.ndarray],
    out: np.ndarray | None = None,
    outside_counts: np.ndarray | None = None,
) -> np.ndarray:
    """Raw ids (rows, 26) -> contiguous ids: vocabulary position + 2, or 1 when not in it. ``out``
    may be ``raw_ids`` itself (each block of rows is read whole before it is written).
    ``outside_counts`` (26,) int64, if given, gets each feature's ids not in its vocabulary added."""
    out = np.empty(raw_ids.shape, dtype=np.int64) if out is None else out
    for start in range(0, raw_ids.shape[0], MAP_BLOCK_ROWS):
        block = slice(start, start + MAP_BLOCK_ROWS)
        # One feature's ids contiguous: binary search over strided columns was ~1.7x slower (measured).
        columns = np.ascontiguousarray(raw_ids[block].T, dtype=np.int64)
        for j, vocabulary in enumerate(vocabularies):
            column = columns[j]
            if vocabulary.size == 0:
                column[:] = RARE_ID
                if outside_counts is not None:
                    outside_counts[j] += column.size
                continue
            position = np.searchsorted(vocabulary, column)
            np.minimum(position, vocabulary.size - 1, out=position)
            found = vocabulary[position] == column
            if outside_counts is not None:  # a pass over a bool column: next to the search, free
                outside_counts[j] += column.size - np.count_nonzero(found)
            position += FIRST_CONTIGUOUS_ID
            np.copyto(column, RARE_ID)
            np.copyto(column, position, where=found)
        out[block] = columns.T
    return out


def count_ids(task: DayTask) -> DayResult:
    """First pass of ``--frequency_threshold``: every id of one file with its count, saved as
    ``day_N_id_counts.npz`` (files, not pickles through a pipe: a Terabyte day has ~10**8 ids)."""
    started = time.perf_counter()
    counter, rows = IdCounter(), 0
    for arrays, _ in iter_chunks(task.input, task.dense_transform, task.on_bad_rows, task.block_bytes):
        counter.add_ids(arrays.sparse)
        rows += len(arrays)
        report_rows(len(arrays))
    save_npz_atomically(task.path("id_counts.npz"), info=np.array(json.dumps(input_info(task))), **counter.npz_members())
    return DayResult(task.day, rows, time.perf_counter() - started)


def vocabulary_sha256(vocabularies: Sequence[np.ndarray]) -> str:
    """The SHA-256 of 26 vocabularies (each one's length, then its ids as little-endian int64): what
    names a vocabulary in cache fingerprints, checkpoints and exports."""
    digest = hashlib.sha256()
    for vocabulary in vocabularies:
        ids = np.ascontiguousarray(vocabulary, dtype="<i8")  # no copy for a memory-mapped int64 file
        digest.update(np.int64(ids.size).tobytes())
        digest.update(memoryview(ids).cast("B"))
    return digest.hexdigest()


def save_vocabularies(
    folder: Path,
    count_files: Sequence[Path],
    threshold: int,
    description: dict,
    setting: str = "--frequency_threshold",
    counted_over: str = "the inputs",
) -> dict[str, Any]:
    """Merge the files' id counts one feature at a time (memory: one feature's distinct ids), keep
    the ids seen >= threshold times; ``vocabulary.json`` is written last, marking them complete.
    Returns what it wrote there. A feature left with no id is kept with an empty vocabulary: all its
    rows share the out-of-vocabulary row (the feature then says nothing), with one warning naming it
    and ``setting`` (small data sets, where every id of a feature is rare, train instead of stopping)."""
    sizes, digest = [], hashlib.sha256()
    for j in range(NUM_SPARSE):
        counter = IdCounter()
        for path in count_files:
            with np.load(path) as counts:
                counter.add_counts(counts[f"ids_{j}"].astype(np.int64), counts[f"counts_{j}"])
        counter.merge()
        kept = counter.keys[counter.counts >= threshold]
        if kept.size == 0 and counter.keys.size:
            warnings.warn(
                f"{setting} {threshold} leaves {SPARSE_NAMES[j]} with no id: each of its {counter.keys.size} "
                f"distinct ids in {counted_over} is seen fewer than {threshold} times, so every row gets its "
                "out-of-vocabulary id 1; lower the threshold for the feature to say something",
                stacklevel=2,
            )
        save_npy_atomically(vocabulary_path(folder, j), kept)
        sizes.append(int(kept.size))
        digest.update(np.int64(kept.size).tobytes())  # as vocabulary_sha256, one feature at a time
        digest.update(memoryview(np.ascontiguousarray(kept, dtype="<i8")).cast("B"))
    written = dict(description, threshold=threshold, sizes=sizes, sha256=digest.hexdigest())
    write_json_atomically(folder / VOCABULARY_FILE, written)
    return written


def prepare_vocabulary(config: Config, inputs: Sequence[Path]) -> dict[str, Any] | None:
    """The vocabulary to map ids with: None (raw ids), a given one, or one counted now (or saved by
    an earlier run over the same inputs with the same threshold)."""
    if config.vocabulary is not None:
        description = read_json(config.vocabulary / "vocabulary.json")
        load_vocabularies(config.vocabulary)  # fail now, naming a missing file, not in every worker
        return dict(description, dir=config.vocabulary)
    if not config.frequency_threshold:
        return None
    # Inputs by name and size, not path: a re-run from another folder is the same run.
    described = [{"name": path.name, "bytes": path.stat().st_size} for path in inputs]
    description = {"threshold": config.frequency_threshold, "inputs": described}
    saved = config.output / "vocabulary.json"
    if saved.is_file():
        previous = read_json(saved)
        if {k: previous.get(k) for k in description} != description:
            # Never overwrite it: days already written there were mapped with it.
            raise ValueError(
                f"{saved}: made with threshold {previous.get('threshold')} from other inputs or with another "
                f"threshold than --frequency_threshold {config.frequency_threshold} now; use a new --output folder"
            )
        print(f"reusing the vocabularies in {config.output} (same inputs and threshold)", file=sys.stderr)
        return dict(previous, dir=config.output)
    tasks = [DayTask(i, p, config.output, config.dense_transform, config.on_bad_rows, config.block_mib << 20, None)
             for i, p in enumerate(inputs)]
    todo = [task for task in tasks if not counted_already(task)]
    run_tasks(count_ids, todo, config.workers, "counting ids", config.progress)
    count_files = [task.path("id_counts.npz") for task in tasks]
    written = save_vocabularies(config.output, count_files, config.frequency_threshold, description)
    for path in count_files:  # the vocabulary replaces them
        path.unlink()
    return dict(written, dir=config.output)


@dataclass(eq=False, repr=False)
class Vocabulary:
    """One frequency threshold's vocabulary: per feature the sorted raw ids seen at least
    ``threshold`` times in the rows it was counted over. Maps raw ids to contiguous ids (position + 2,
    or 1 for any other id) by binary search.

    Memory: 8 bytes per kept id (int64), memory-mapped when read from a folder (the pages are shared
    by every process that maps the same file); mapping costs ``log2(size)`` probes per id.

    Args:
        threshold: the T it was made with.
        ids: 26 sorted int64 arrays of raw ids.
        sha256: :func:`vocabulary_sha256` of ``ids``: what names it in fingerprints and checkpoints.
        folder: where its files are, or None when it lives in memory only (read from an export).
    """

    threshold: int
    ids: list[np.ndarray]
    sha256: str
    folder: Path | None = None

    @classmethod
    def load(cls, folder: Path) -> "Vocabulary":
        """The vocabulary saved in ``folder`` (its arrays memory-mapped)."""
        description = read_json(folder / VOCABULARY_FILE)
        ids = load_vocabularies(folder)
        # vocabulary.json from before the digest was recorded: computed once here.
        sha256 = description.get("sha256") or vocabulary_sha256(ids)
        return cls(int(description["threshold"]), ids, sha256, folder)

    @classmethod
    def from_plain(cls, plain: dict[str, Any]) -> "Vocabulary":
        """The inverse of :meth:`to_plain` (the arrays may be tensors, e.g. memory-mapped from an export)."""
        ids = [np.asarray(array.numpy() if hasattr(array, "numpy") else array, dtype=np.int64) for array in plain["ids"]]
        if len(ids) != NUM_SPARSE:
            raise ValueError(f"a vocabulary has {NUM_SPARSE} features, this one {len(ids)}")
        return cls(int(plain["threshold"]), ids, str(plain["sha256"]))

    def to_plain(self) -> dict[str, Any]:
        """Threshold, sizes, digest and the arrays as int64 tensors: what ``torch.load(weights_only=True)``
        reads back (an exported model file holds it)."""
        import torch  # only here: the preprocessor's workers never need torch

        ids = [torch.from_numpy(np.array(array, dtype=np.int64)) for array in self.ids]  # a copy: mapped files are read-only
        return dict(self.describe(), ids=ids)

    def __repr__(self) -> str:
        return f"Vocabulary(threshold={self.threshold}, sizes={self.sizes}, sha256={self.sha256[:12]}..., folder={self.folder})"

    @property
    def sizes(self) -> list[int]:
        """Kept ids per feature."""
        return [int(array.size) for array in self.ids]

    @property
    def table_sizes(self) -> list[int]:
        """Embedding rows each feature needs: its kept ids, the shared id 1, and 0 (never used)."""
        return [size + FIRST_CONTIGUOUS_ID for size in self.sizes]

    def describe(self) -> dict[str, Any]:
        """What names the vocabulary, as plain data (no arrays)."""
        return {"threshold": self.threshold, "sizes": self.sizes, "sha256": self.sha256}

    def map(
        self, raw_ids: np.ndarray, out: np.ndarray | None = None, outside_counts: np.ndarray | None = None
    ) -> np.ndarray:
        """Raw ids (rows, 26) -> contiguous ids (int64; into ``out``, which may be ``raw_ids``).
        ``outside_counts`` (26,) int64, if given, gets each feature's ids mapped to 1 added."""
        return map_to_contiguous(raw_ids, self.ids, out, outside_counts)

    def save(self, folder: Path) -> None:
        """Write the vocabulary into ``folder`` (created), ``vocabulary.json`` last. Files of a vocabulary
        read from a folder are hard-linked where the file system allows (they are never rewritten in
        place: a new vocabulary replaces files by rename), else copied."""
        folder.mkdir(parents=True, exist_ok=True)
        for j, array in enumerate(self.ids):
            target = vocabulary_path(folder, j)
            if self.folder is not None:
                link_or_copy(vocabulary_path(self.folder, j), target)
            else:
                save_npy_atomically(target, np.asarray(array, dtype=np.int64))
        write_json_atomically(folder / VOCABULARY_FILE, self.describe())

    def __getstate__(self) -> dict[str, Any]:
        # A vocabulary backed by files travels between processes as its folder (pickling a memory
        # map would copy all of it); one in memory travels whole.
        if self.folder is not None:
            return {"folder": self.folder}
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        if set(state) == {"folder"}:
            state = Vocabulary.load(state["folder"]).__dict__
        self.__dict__.update(state)

