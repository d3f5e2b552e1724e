"""Raw Criteo TSV -> TorchRec's NumPy day files, streamed, in parallel, resumable.

Usage::

    python -m app.data.preprocess --input '[day_0.gz, day_1.gz]' --output DIR [--workers N]
    python -m app.data.preprocess --input 'raw/day_*' --output DIR --frequency_threshold 3
    python -m app.data.preprocess --input test.txt --output DIR_TEST --vocabulary DIR   # map like DIR
    python -m app.data.preprocess --config preprocess.yaml                             # options in a file

Input file ``i`` (in the order given, after glob/directory expansion) becomes day ``i``:

* ``day_i_dense.npy``   float32 (rows, 13): the transformed integer features (``--dense_transform``)
* ``day_i_sparse.npy``  int32 (rows, 26): the raw 32-bit hashed ids (their bits: read them as uint32), or contiguous ids with
  ``--frequency_threshold``/``--vocabulary`` (ids seen >= T times -> 2, 3, ...; the others -> 1,
  TorchRec's contiguous_preproc_criteo convention)
* ``day_i_labels.npy``  int32 (rows, 1): 0/1, or -1 for an unlabelled (39-field) file
* ``day_i_stats.npz``   this day's counts and distinct raw ids (for metadata.json and resuming)

and ``metadata.json`` describes the whole set (see ``build_metadata``). Read the result with
``app.data.numpy_days.NumpyDaysSource``.

``--frequency_threshold T`` makes two passes: the first counts every id per feature in each file
(``day_i_id_counts.npz``, in parallel), merges the counts one feature at a time and saves the ids
seen >= T times as ``vocab_feature_j.npy`` (sorted raw ids, int64) with ``vocabulary.json``; the
second writes the days with contiguous ids. ``--vocabulary DIR`` maps with the vocabularies of an
earlier run instead (e.g. test data like the training data).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from app.command import run_command
from app.data.preprocess.config import DEFAULT_BLOCK_MIB, Config
from app.data.preprocess.runner import run


def default_workers() -> int:
    """The cores this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def preprocess(
    input: str | list[str],
    output: str,
    workers: int | None = None,
    frequency_threshold: int = 0,
    vocabulary: str | None = None,
    dense_transform: Literal["log1p", "log_plus_3"] = "log1p",
    on_bad_rows: Literal["error", "skip"] = "error",
    block_mib: int = DEFAULT_BLOCK_MIB,
    progress: bool = True,
) -> None:
    """Raw Criteo TSV -> TorchRec's NumPy day files (day_N_{dense,sparse,labels}.npy and
    metadata.json), streamed, in parallel, resumable: re-running with the same inputs and output
    skips the days already complete. See docs/data.md.

    Args:
        input: raw TSV files: a file, a glob ('raw/day_*'), a folder (of *.tsv/*.txt/*.gz) or a
            list of those, in day order; .gz is read as gzip. Input file i becomes day i.
        output: folder to write the days to (created if needed).
        workers: processes converting files in parallel, one file each (default: the cores here).
        frequency_threshold: 0: keep the raw 32-bit ids. T >= 1: count ids over all inputs first,
            then write contiguous ids: ids seen >= T times -> 2, 3, ... (sorted by raw id), others
            -> 1; the vocabularies are saved as vocab_feature_j.npy. T = 1 gives contiguous ids
            for every id seen.
        vocabulary: map ids with the vocabularies saved in this folder by an earlier run (e.g. the
            training days), so that these days use the same contiguous ids; ids not in them -> 1.
        dense_transform: log1p: log(max(x, 0) + 1) (facebookresearch/dlrm); log_plus_3: TorchRec's
            former log(x + 3), x clamped to >= -2. Recorded in metadata.json.
        on_bad_rows: error: stop at the first malformed row, naming file and line; skip: leave such
            rows out and count them in metadata.json.
        block_mib: MiB of text parsed per chunk; memory per worker is a few times this.
        progress: show a progress bar of the rows parsed.
    """
    run(
        Config(
            inputs=[input] if isinstance(input, str) else list(input),
            output=Path(output).expanduser(),
            workers=default_workers() if workers is None else workers,
            frequency_threshold=frequency_threshold,
            vocabulary=None if vocabulary is None else Path(vocabulary).expanduser(),
            dense_transform=dense_transform,
            on_bad_rows=on_bad_rows,
            block_mib=block_mib,
            progress=progress,
        )
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m app.data.preprocess``; returns the exit status (2 for a bad input)."""
    return run_command(preprocess, "python -m app.data.preprocess", argv)
