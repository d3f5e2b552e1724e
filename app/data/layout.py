"""The data layout a model was trained with: which input features it saw and how each was made from the
raw data, recorded in checkpoints so that what reads a checkpoint later (the pt2 export, a server) knows
them without the training data.

A layout is plain JSON data, kept in the data module's checkpoint state under :data:`DATA_LAYOUT_KEY`::

    {"format": "parquet",                       # tsv | numpy | multi_hot | parquet: the training files'
     "dense": [{"name": "price", "transform": "none", "fill": 0.0}, ...],      # the model's dense inputs
     "categorical": [{"name": "user", "ids": "string", "max_length": 0}, ...]}  # its tables' features

``transform``: ``log1p``, ``log_plus_3`` or ``none`` (the readers' transforms), or null where the
training files do not say (NumPy days written by another preprocessor). ``ids``: ``hex`` (Criteo's
hex ids read as numbers), ``integer``, ``string`` (hashed by the reader), ``contiguous`` (NumPy days
whose ids a preprocessor's vocabulary already mapped) or null (NumPy days that do not say). ``max_length`` > 0: a list column; -1:
MLPerf's multi-hot days. A checkpoint without a layout was trained on Criteo's TSV:
:func:`criteo_layout`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from app.criteo import DENSE_NAMES, SPARSE_NAMES
from app.data.parquet.schema import ParquetSchema

DATA_LAYOUT_KEY = "data_layout"
MULTI_HOT_LENGTH = -1  # max_length of a multi-hot day file's features: several ids per row, not a list column


def criteo_layout(
    format: str = "tsv", dense_transform: str | None = "log1p", ids: str | None = "hex", max_length: int = 0
) -> dict[str, Any]:
    """Criteo's fixed layout: I1..I13 through ``dense_transform`` (a missing count is 0), C1..C26."""
    return {
        "format": format,
        "dense": [{"name": name, "transform": dense_transform, "fill": 0.0} for name in DENSE_NAMES],
        "categorical": [{"name": name, "ids": ids, "max_length": max_length} for name in SPARSE_NAMES],
    }


def parquet_layout(schema: ParquetSchema) -> dict[str, Any]:
    """The features a ``data.schema`` names, in the model's input order."""
    values = schema.as_dict()
    return {"format": "parquet", "dense": values["dense"], "categorical": values["categorical"]}


def training_layout(format: str, files: Sequence[Path], schema: ParquetSchema, dense_transform: str) -> dict[str, Any]:
    """The layout of training files of ``format`` (resolved, never ``auto``) read with these settings."""
    if format == "parquet":
        return parquet_layout(schema)
    if format == "tsv":
        return criteo_layout("tsv", dense_transform)
    if format == "multi_hot":
        return criteo_layout("multi_hot", _preprocessed(files).get("dense_transform"), "hex", MULTI_HOT_LENGTH)
    metadata = _preprocessed(files)  # numpy days: transformed and mapped by the preprocessor that wrote them
    ids = {"raw": "hex", "contiguous": "contiguous"}.get(metadata.get("sparse_ids"))  # None: not recorded
    return criteo_layout("numpy", metadata.get("dense_transform"), ids)


def _preprocessed(files: Sequence[Path]) -> dict[str, Any]:
    """``app.data.preprocess``'s metadata.json of a folder of days; {} where another tool wrote them."""
    folder = files[0] if files and files[0].is_dir() else (files[0].parent if files else Path("."))
    try:
        return json.loads((folder / "metadata.json").read_text())
    except (OSError, ValueError):
        return {}


def saved_layout(data_state: dict[str, Any]) -> dict[str, Any]:
    """The layout in a data module's checkpoint state; Criteo's TSV layout where it holds none (a
    checkpoint written before layouts were recorded)."""
    layout = data_state.get(DATA_LAYOUT_KEY)
    return layout if isinstance(layout, dict) else criteo_layout()
