"""``data.num_embeddings_per_feature``: the rows of each embedding table, as set or counted from the
training data.

The data hashes every id modulo its table's size, so the model's tables take exactly these sizes. A
list (or one int) is known at once; ``auto`` is known only once the training data has been cached
(or its vocabulary counted), which happens in the data module's ``setup`` behind the strategy's
barrier, so the model builds its tables there too (``DLRMModule.setup``). A checkpoint carries its
sizes: scoring it sets them from the checkpoint (app/checkpoint/saved_model.py), never from data.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from app.criteo import expand_table_sizes
from app.data.cache import read_metadata
from app.data.preprocess import Vocabulary
from app.data.splits import SplitFiles

AUTO = "auto"
SETTING = "data.num_embeddings_per_feature"
TableSizeSetting = int | list[int] | Literal["auto"]


def sizes_as_set(setting: TableSizeSetting) -> list[int] | None:
    """The 26 table sizes a setting names, or None for ``auto`` (known once the training data is read)."""
    if setting == AUTO:
        return None
    return expand_table_sizes(setting, SETTING)  # type: ignore[arg-type]


CACHED_FORMATS = ("tsv", "parquet")  # converted into the cache's NumPy days before they are read


def sizes_from_vocabulary(vocabulary: Vocabulary) -> list[int]:
    """``auto`` with ``data.frequency_threshold``: one row per kept id, plus the shared and the missing id."""
    return list(vocabulary.table_sizes)


def sizes_from_days(train: SplitFiles, cached_folder: Path | None) -> tuple[list[int], Path]:
    """``auto`` without a threshold: the exact number of distinct ids per feature, from the metadata of
    the training data's cached days (``cached_folder``, raw TSV) or of its preprocessed NumPy folder.
    Returns the sizes and the metadata file they came from."""
    if train.format in CACHED_FORMATS:
        assert cached_folder is not None, "raw TSV and Parquet are sized from their cache"
        folder = cached_folder
    elif train.format == "numpy":
        folder = train.files[0]
    else:
        raise ValueError(f"{SETTING}: auto needs raw TSV or app.data.preprocess's NumPy days, not multi_hot")
    metadata = read_metadata(folder)
    sizes = metadata.get("num_embeddings_per_feature") or metadata["distinct_ids_per_feature"]
    return [max(1, int(size)) for size in sizes], folder / "metadata.json"
