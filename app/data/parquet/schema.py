"""The feature schema of Parquet input (``data.schema``): which columns are the label, the dense
features and the categorical features, and how each becomes a model input.

The model has Criteo's shape (13 dense features, 26 embedding tables, ``app/criteo.py``), so a schema
names up to 13 dense and up to 26 categorical columns, in the order of the model's inputs; the inputs
no column fills hold a constant (dense 0, id 0), which says nothing and costs one table row each with
``num_embeddings_per_feature: auto``. Without a schema the columns are Criteo's own names, as
``python -m app.data.to_parquet`` writes them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from app.criteo import DENSE_NAMES, NUM_DENSE, NUM_SPARSE, SPARSE_NAMES

DenseTransformName = Literal["log1p", "none"]
IdKind = Literal["integer", "string", "hex"]


@dataclass(frozen=True)
class DenseColumn:
    """A numeric column read as one dense feature.

    Args:
        name: the column's name in the Parquet files (integer or floating point).
        transform: ``log1p``: log(max(x, 0) + 1), computed in float64 and rounded once to float32
            (as for raw TSV); ``none``: the value as float32.
        fill: the value of a null (missing) entry; unset (null): a null stops the conversion,
            naming the file, the column, the row group and how many there are.
    """

    name: str
    transform: DenseTransformName = "log1p"
    fill: float | None = None


@dataclass(frozen=True)
class CategoricalColumn:
    """A column of ids read as one categorical feature (one embedding table).

    Args:
        name: the column's name in the Parquet files.
        ids: ``integer``: integer ids in 0 .. 2**32 - 1, kept as they are (others stop the conversion);
            ``string``: any strings, hashed to 32-bit ids (64-bit FNV-1a folded to 32 bits);
            ``hex``: strings of 1 to 8 hexadecimal digits, read as the number they write (Criteo's ids,
            so that Parquet and raw TSV give the very same ids). A null is id 0, as an empty TSV field.
        max_length: 0: one id per row. N >= 1: a list column (a multi-valued feature: the last items a
            user clicked) of at most N ids per row, longer lists cut to their first N (counted, one
            warning per file); the ids reach the model as a jagged feature (each row's own length, a
            null or empty list none) and their embeddings are summed.
    """

    name: str
    ids: IdKind = "string"
    max_length: int = 0


def _criteo_dense() -> list[DenseColumn]:
    return [DenseColumn(name, "log1p", 0.0) for name in DENSE_NAMES]


def _criteo_categorical() -> list[CategoricalColumn]:
    return [CategoricalColumn(name, "hex") for name in SPARSE_NAMES]


@dataclass(frozen=True)
class ParquetSchema:
    """Which Parquet columns are the label and the features (``data.format: parquet``).

    Args:
        label: the label column: 0/1 (integer, boolean or floating point); nulls and other values stop
            the conversion. A file without it is unlabelled (only ``predict`` reads those).
        dense: up to 13 numeric columns, the model's dense inputs I1.. in order (the rest hold 0).
            Default: I1..I13, log1p, nulls 0.
        categorical: 1 to 26 id columns, the model's tables C1.. in order, one each (the rest hold id 0);
            table sizes, the frequency threshold and the vocabulary apply to them as to Criteo's C1..C26.
            Default: C1..C26 as hex.
        group: a column of group ids (e.g. the user id; integers, or strings hashed to 64 bits) for GAUC,
            the per-group AUC logged beside the AUC for validation and test (``val/gauc``); it may also be
            a categorical feature. Unset: no GAUC.
        key_columns: columns that ``predict`` writes beside each row's probability in predictions.tsv
            (e.g. a request and an item id), read from the predict files as text.
    """

    label: str = "label"
    dense: list[DenseColumn] = field(default_factory=_criteo_dense)
    categorical: list[CategoricalColumn] = field(default_factory=_criteo_categorical)
    group: str | None = None
    key_columns: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.dense) > NUM_DENSE:
            raise ValueError(f"data.schema.dense has {len(self.dense)} columns; the model takes at most {NUM_DENSE}")
        if not 1 <= len(self.categorical) <= NUM_SPARSE:
            raise ValueError(
                f"data.schema.categorical has {len(self.categorical)} columns; the model takes 1 to {NUM_SPARSE}"
            )
        names = [self.label] + [c.name for c in self.dense] + [c.name for c in self.categorical]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"data.schema names column {repeated[0]!r} more than once")
        for column in self.categorical:
            if column.max_length < 0:
                raise ValueError(f"data.schema.categorical {column.name!r}: max_length = {column.max_length} must be >= 0")

    @property
    def list_features(self) -> dict[int, int]:
        """Model feature index -> the most ids a row holds, for the list (multi-valued) columns."""
        return {j: c.max_length for j, c in enumerate(self.categorical) if c.max_length}

    def as_dict(self) -> dict[str, Any]:
        """The schema as plain JSON values: for the cache's fingerprint and the conversion's workers."""
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ParquetSchema:
        """The schema :meth:`as_dict` gave."""
        return cls(
            values["label"],
            [DenseColumn(**column) for column in values["dense"]],
            [CategoricalColumn(**column) for column in values["categorical"]],
            values.get("group"),
            list(values.get("key_columns", [])),
        )


def check_list_settings(schema: ParquetSchema, frequency_threshold: int) -> None:
    """Refuses a frequency threshold with list columns, naming them: their ids are hashed into the
    table sizes (``auto``: the distinct ids seen, as for raw ids), not mapped by a vocabulary."""
    names = [c.name for c in schema.categorical if c.max_length]
    if not names:
        return
    if frequency_threshold:
        raise ValueError(
            f"data.frequency_threshold = {frequency_threshold} does not apply to the list columns of data.schema "
            f"({', '.join(names)}): their ids are hashed into the table sizes; set data.frequency_threshold 0"
        )
