"""The mean and standard deviation of each ``transform: standardize`` dense column, over the training
rows only: one pass of pyarrow over those columns of the training files, before any split is
converted, so that every split (validation, test, predict) is standardised with the training rows'
figures and the cached days hold (x - mean) / std.

They are kept in the cache beside the training days (a folder of the cache's protocol, one JSON
file) and in checkpoints and exported models (the data module's state), so that scoring a checkpoint
needs neither the training files nor their cache.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from app.data.cache import CacheRequest, cached_folder
from app.data.parquet.reader import BYTES_PER_ROW_ESTIMATE, dense_float64, open_parquet
from app.data.parquet.schema import DenseColumn, ParquetSchema

# Column name -> [mean, std] of its training values (after fill), in float64: JSON keeps them exactly.
DenseStatistics = dict[str, list[float]]

STATISTICS_FILE = "dense_statistics.json"
STATISTICS_KEY = "dense_statistics"  # in the conversion's schema (the cache's fingerprint) and the data module's state
CHUNK_ROWS = (8 << 20) // BYTES_PER_ROW_ESTIMATE  # rows read at a time: the conversion's chunk


def standardized_columns(schema: ParquetSchema) -> list[DenseColumn]:
    """The dense columns whose transform is ``standardize``."""
    return [column for column in schema.dense if column.transform == "standardize"]


def training_statistics(request: CacheRequest, schema: ParquetSchema, convert: bool) -> DenseStatistics:
    """The training files' statistics of the standardised columns, counted once (``convert``: this
    process may count them) and then read from the cache; ``request``: the training files' conversion."""
    columns = standardized_columns(schema)
    folder = request.folder.parent / f"{request.folder.name}-{STATISTICS_KEY}"
    fingerprint = request.fingerprint() | {STATISTICS_KEY: [column.name for column in columns]}

    def count(out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        (out / STATISTICS_FILE).write_text(json.dumps(count_statistics(request.inputs, columns), indent=1) + "\n")

    done = cached_folder(folder, fingerprint, count, convert, request.wait_s)
    return json.loads((done / STATISTICS_FILE).read_text())


def count_statistics(paths: tuple[Path, ...], columns: list[DenseColumn]) -> DenseStatistics:
    """Mean and population standard deviation (ddof 0) of each column over every row of ``paths``, nulls
    filled as the conversion fills them; chunks merged with Chan et al.'s pairwise update in float64.

    Raises:
        ValueError: naming the column, for one whose training values are all equal (std 0: nothing to
            divide by), and as the conversion does for nulls without a fill.
    """
    moments = {column.name: (0, 0.0, 0.0) for column in columns}  # rows, mean, sum of squared deviations
    for path in paths:
        file = open_parquet(path)
        for group in range(file.metadata.num_row_groups):
            names = [column.name for column in columns]
            for batch in file.iter_batches(batch_size=CHUNK_ROWS, row_groups=[group], columns=names):
                for column in columns:
                    values = dense_float64(batch.column(column.name), column, f"{path}: row group {group}")
                    moments[column.name] = _merged(moments[column.name], values)
    statistics = {}
    for column in columns:
        rows, mean, squares = moments[column.name]
        std = float(np.sqrt(squares / rows))
        if not std > 0:
            raise ValueError(
                f"data.schema.dense {column.name!r}: transform standardize divides by the standard deviation of the "
                f"training rows, and their {rows} values all equal {mean:g} (std 0); use transform none or drop the column"
            )
        statistics[column.name] = [float(mean), std]
    return statistics


def _merged(moments: tuple[int, float, float], values: np.ndarray) -> tuple[int, float, float]:
    rows, mean, squares = moments
    if values.size == 0:
        return moments
    chunk_mean = float(values.mean())
    chunk_squares = float(((values - chunk_mean) ** 2).sum())
    total = rows + values.size
    delta = chunk_mean - mean
    return total, mean + delta * values.size / total, squares + chunk_squares + delta * delta * rows * values.size / total


def check_restored_statistics(
    restored: DenseStatistics, counted: DenseStatistics | None, schema: ParquetSchema
) -> DenseStatistics:
    """A checkpoint's statistics, which standardise every split from then on: refused when they lack a
    standardised column of ``schema``, or differ from those this run already counted over data.train
    (its splits are cached with those)."""
    restored = {name: [float(mean), float(std)] for name, (mean, std) in restored.items()}
    missing = [column.name for column in standardized_columns(schema) if column.name not in restored]
    if missing:
        raise ValueError(
            f"data.schema.dense {missing[0]!r}: transform standardize, but the checkpoint holds statistics for "
            f"{', '.join(restored) or 'no column'} only (it was trained with another transform there)"
        )
    if counted is not None and counted != restored:
        raise ValueError(
            f"the checkpoint's dense statistics {restored} differ from those counted over data.train {counted}: "
            "use the training data of that checkpoint"
        )
    return restored
