"""The model's inputs from a data schema: exactly its dense and categorical columns, named, and one table
size per column, those of columns sharing a table the same.

The cache stores rows of Criteo's width (13 dense values, 26 ids: ``app/data/parquet/reader.py``); a
schema of fewer columns leaves the rest constant there. :class:`ModelInputs` cuts every block of rows
to the schema's columns and names its features after them, so the model has no constant input.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from app.criteo import NUM_SPARSE, expand_table_sizes
from app.data.parquet.schema import ParquetSchema
from app.data.source import RowBlock, RowSource

SETTING = "data.num_embeddings_per_feature"


class ModelInputs:
    """A source's rows cut to the first ``num_dense`` dense values and the first ``len(feature_names)``
    categorical features, which the batches name ``feature_names``."""

    def __init__(self, source: RowSource, num_dense: int, feature_names: Sequence[str]) -> None:
        self.source, self.num_dense, self.feature_names = source, num_dense, tuple(feature_names)

    def __len__(self) -> int:
        return len(self.source)

    @property
    def in_memory(self) -> bool:
        return self.source.in_memory

    def view(self, start: int, stop: int) -> ModelInputs:
        """Rows ``[start, stop)``, without copying them."""
        return ModelInputs(self.source.view(start, stop), self.num_dense, self.feature_names)  # type: ignore[attr-defined]

    def take(self, rows: np.ndarray) -> RowBlock:
        block = self.source.take(rows)
        count = len(self.feature_names)
        sparse = block.sparse[:, :count] if isinstance(block.sparse, np.ndarray) else list(block.sparse[:count])
        return RowBlock(block.dense[:, : self.num_dense], sparse, block.labels, self.feature_names)


def set_table_sizes(schema: ParquetSchema, setting: int | list[int]) -> list[int]:
    """The 26 sizes of the cache's id columns from a size setting for a schema's columns: one size for all,
    or one per categorical column (columns sharing a table: the same); the columns no feature uses: 1."""
    names = [column.name for column in schema.categorical]
    if isinstance(setting, list) and len(setting) != len(names):
        raise ValueError(
            f"{SETTING} has {len(setting)} sizes; give {len(names)}, one per categorical column of data.schema "
            f"({', '.join(names)}), or a single size for all"
        )
    sizes = expand_table_sizes(setting, SETTING, require_all=False)[: len(names)]
    for table, features in schema.shared_tables.items():
        given = {sizes[j] for j in features}
        if len(given) > 1:
            first, other = features[0], next(j for j in features if sizes[j] != sizes[features[0]])
            raise ValueError(
                f"{SETTING} gives {sizes[first]} rows to {names[first]!r} and {sizes[other]} to {names[other]!r}, which "
                f"share table {table!r} of data.schema: give them one size"
            )
    return padded(sizes)


def counted_table_sizes(schema: ParquetSchema, counted: Sequence[int]) -> list[int]:
    """``auto`` sizes with shared tables: each shared table the sum of its columns' distinct ids, which
    covers every id of them all (the ids of one table's columns share its rows)."""
    sizes = [int(size) for size in counted]
    for features in schema.shared_tables.values():
        total = sum(sizes[j] for j in features)
        for j in features:
            sizes[j] = total
    return sizes


def padded(sizes: Sequence[int]) -> list[int]:
    """The schema's sizes, then 1 for each id column of the cache that no feature uses."""
    return list(sizes) + [1] * (NUM_SPARSE - len(sizes))
