"""Raw Criteo TSV -> TorchRec's NumPy day files, streamed, in parallel, resumable.

Usage::

    python -m app.preprocess --input day_0.gz day_1.gz ... --output DIR [--workers N]
    python -m app.preprocess --input 'raw/day_*' --output DIR --frequency-threshold 3
    python -m app.preprocess --input test.txt --output DIR_TEST --vocabulary DIR   # map like DIR

Input file ``i`` (in the order given, after glob/directory expansion) becomes day ``i``:

* ``day_i_dense.npy``   float32 (rows, 13): the transformed integer features (``--dense-transform``)
* ``day_i_sparse.npy``  int64 (rows, 26): the raw 32-bit hashed ids, or contiguous ids with
  ``--frequency-threshold``/``--vocabulary`` (ids seen >= T times -> 2, 3, ...; the others -> 1,
  TorchRec's contiguous_preproc_criteo convention)
* ``day_i_labels.npy``  int32 (rows, 1): 0/1, or -1 for an unlabelled (39-field) file
* ``day_i_stats.npz``   this day's counts and distinct raw ids (for metadata.json and resuming)

and ``metadata.json`` describes the whole set (see ``build_metadata``). Read the result with
``app.data.numpy_days.NumpyDaysSource``.

``--frequency-threshold T`` makes two passes: the first counts every id per feature in each file
(``day_i_id_counts.npz``, in parallel), merges the counts one feature at a time and saves the ids
seen >= T times as ``vocab_feature_j.npy`` (sorted raw ids, int64) with ``vocabulary.json``; the
second writes the days with contiguous ids. ``--vocabulary DIR`` maps with the vocabularies of an
earlier run instead (e.g. test data like the training data).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from app.preprocess.config import DEFAULT_BLOCK_MIB, DENSE_TRANSFORMS, Config
from app.preprocess.runner import run


def default_workers() -> int:
    """The cores this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m app.preprocess",
        description=__doc__,  # what it writes, with examples
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Re-running with the same inputs and output skips the days already complete.",
    )
    parser.add_argument("--input", nargs="+", required=True, metavar="FILE",
                        help="raw TSV files, globs or folders (of *.tsv/*.txt), in day order; .gz is read as gzip")
    parser.add_argument("--output", required=True, type=Path, metavar="DIR",
                        help="folder to write the days to (created if needed)")
    parser.add_argument("--workers", type=int, default=default_workers(),
                        help="processes converting files in parallel, one file each "
                        "(default: the cores here, %(default)s)")
    parser.add_argument("--frequency-threshold", type=int, default=0, metavar="T",
                        help="0 (default): keep the raw 32-bit ids. T >= 1: count ids over all inputs first, then "
                        "write contiguous ids: ids seen >= T times -> 2, 3, ... (sorted by raw id), others -> 1; the "
                        "vocabularies are saved as vocab_feature_j.npy. T = 1 gives contiguous ids for every id seen.")
    parser.add_argument("--vocabulary", type=Path, default=None, metavar="DIR",
                        help="map ids with the vocabularies saved in DIR by an earlier run (e.g. the training days), "
                        "so that these days use the same contiguous ids; ids not in them -> 1")
    parser.add_argument("--dense-transform", choices=DENSE_TRANSFORMS, default="log1p",
                        help="log1p: log(max(x, 0) + 1) (default, facebookresearch/dlrm); log_plus_3: TorchRec's "
                        "former log(x + 3), x clamped to >= -2. Recorded in metadata.json.")
    parser.add_argument("--on-bad-rows", choices=("error", "skip"), default="error",
                        help="error (default): stop at the first malformed row, naming file and line; skip: leave "
                        "such rows out and count them in metadata.json")
    parser.add_argument("--block-mib", type=int, default=DEFAULT_BLOCK_MIB,
                        help="MiB of text parsed per chunk (default %(default)s); "
                        "memory per worker is a few times this")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m app.preprocess``; returns the exit status (2 for a bad input)."""
    args = build_parser().parse_args(argv)
    config = Config(
        inputs=list(args.input),
        output=args.output,
        workers=args.workers,
        frequency_threshold=args.frequency_threshold,
        vocabulary=args.vocabulary,
        dense_transform=args.dense_transform,
        on_bad_rows=args.on_bad_rows,
        block_mib=args.block_mib,
        progress=args.progress,
    )
    try:
        run(config)
    except (ValueError, FileNotFoundError) as error:  # CriteoFormatError is a ValueError
        if os.environ.get("APP_TRACEBACK"):
            raise
        print(f"error: {error}\n(set APP_TRACEBACK=1 to see the traceback)", file=sys.stderr)
        return 2
    return 0
