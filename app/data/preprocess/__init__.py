"""Raw Criteo TSV -> TorchRec's NumPy day files, streamed, in parallel, resumable.

``python -m app.data.preprocess --help`` (:mod:`app.data.preprocess.cli`) says what is written and how to run it.

Streaming: every chunk of parsed rows is appended to the three output files at once, so memory is
bounded by the chunk size, not the input size. Each .npy file starts with the header for zero rows,
which NumPy pads so that the row count can grow to 21 digits without changing the header's length
(``numpy.lib.format.GROWTH_AXIS_MAX_DIGITS``); when the day is done the header is rewritten in
place with the real row count. No output is read back or copied.

Resuming: a day is written under ``*.partial-<host>-<pid>`` names (one per writer) and renamed when
complete, so a day whose files all exist is finished: a re-run skips it (checking it was made from
the same input file, by name and size, with the same options) and redoes only the others. The first pass of
``--frequency_threshold`` resumes the same way (per file's id counts, then the saved vocabularies).

Memory per worker: a few chunks (``--block_mib``) plus the distinct ids of its file. With
``--frequency_threshold`` the main process also holds one feature's distinct ids over all files
with their counts while merging (as TorchRec's own contiguous preprocessing does).

One job per module: ``cli`` (the command line), ``config`` (the options and one day's task),
``runner`` (the whole run), ``chunks`` (raw TSV in chunks), ``day`` (one input file -> one day),
``vocabulary`` (--frequency_threshold's counting pass, --vocabulary, mapping ids), ``id_counts``
(exact id counts), ``resume`` (which days and counts an earlier run finished), ``metadata``
(metadata.json), ``workers`` (worker processes with one progress bar), ``files`` (files written
whole or not at all).
"""

from app.data.preprocess.chunks import RAW_IDS, iter_chunks
from app.data.preprocess.cli import default_workers, main, preprocess
from app.data.preprocess.config import DEFAULT_BLOCK_MIB, DENSE_TRANSFORMS, FORMAT_VERSION, Config, DayResult, DayTask
from app.data.preprocess.day import convert_day
from app.data.preprocess.files import NpyStreamWriter, read_sidecar_info
from app.data.preprocess.id_counts import FEATURE_OFFSETS, DistinctIds, IdCounter
from app.data.preprocess.metadata import build_metadata
from app.data.preprocess.runner import run
from app.data.preprocess.vocabulary import (
    FIRST_CONTIGUOUS_ID,
    RARE_ID,
    VOCABULARY_FILE,
    Vocabulary,
    count_ids,
    load_vocabularies,
    map_to_contiguous,
    save_vocabularies,
    vocabulary_path,
    vocabulary_sha256,
)
from app.data.preprocess.workers import run_tasks

__all__ = [
    "DEFAULT_BLOCK_MIB",
    "DENSE_TRANSFORMS",
    "FEATURE_OFFSETS",
    "FIRST_CONTIGUOUS_ID",
    "FORMAT_VERSION",
    "RARE_ID",
    "RAW_IDS",
    "VOCABULARY_FILE",
    "Vocabulary",
    "Config",
    "DayResult",
    "DayTask",
    "DistinctIds",
    "IdCounter",
    "NpyStreamWriter",
    "build_metadata",
    "convert_day",
    "count_ids",
    "default_workers",
    "iter_chunks",
    "load_vocabularies",
    "main",
    "preprocess",
    "map_to_contiguous",
    "read_sidecar_info",
    "run",
    "run_tasks",
    "save_vocabularies",
    "vocabulary_path",
    "vocabulary_sha256",
]
