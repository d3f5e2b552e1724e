"""The feature schema of Parquet input (``data.schema``): which columns are the label, the dense
features and the categorical features, and how each becomes a model input.

The model takes exactly the schema's features: its dense columns, and its categorical columns, each
looking up its own table or one it shares with other columns, of its own dim and pooling. The cache
keeps Criteo's row width (13 dense values, 26 ids, ``app/criteo.py``), so a schema names up to 13 dense
and up to 26 categorical columns. Without a schema the columns are Criteo's own names, as
``python -m app.data.to_parquet`` writes them, and the model is Criteo's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from app.criteo import DENSE_NAMES, NUM_DENSE, NUM_SPARSE, SPARSE_NAMES

DenseTransformName = Literal["log1p", "standardize", "none"]
IdKind = Literal["integer", "string", "hex"]


@dataclass(frozen=True)
class DenseColumn:
    """A numeric column read as one dense feature.

    Args:
        name: the column's name in the Parquet files (integer or floating point).
        transform: ``log1p``: log(max(x, 0) + 1), computed in float64 and rounded once to float32
            (as for raw TSV); ``standardize``: (x - mean) / std, with the mean and the standard deviation
            (ddof 0) of the training rows, counted before conversion and kept in the cache and the
            checkpoint (a column whose training values are all equal is refused); ``none``: the value
            as float32.
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
            null or empty list none) and their embeddings pooled (``pooling``).
        table: the embedding table it looks up; unset: a table of its own, named after the column. Columns
            naming the same table share it (one row per id for both: the last items a user clicked and
            the item of the row); they must read their ids alike (``ids``), and the table's size covers
            them all.
        dim: the width of its table's embeddings, a multiple of 4; unset: ``model.embedding_dim``. Only ``model.interaction:
            cat`` takes tables of several widths (the dot product of TorchRec's and TorchEasyRec's DLRM
            needs one width, as do DCN and the projection interaction).
        pooling: how a row's ids become one embedding: ``sum`` (the default) or ``mean`` (for list
            columns: the sum divided by the row's number of ids). A setting of the table: columns sharing
            it may set it once.
    """

    name: str
    ids: IdKind = "string"
    max_length: int = 0
    table: str | None = None
    dim: int | None = None
    pooling: str | None = None

    @property
    def table_name(self) -> str:
        """The table this column looks up."""
        return self.name if self.table is None else self.table


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
        dense: up to 13 numeric columns, the model's dense inputs in order (exactly these).
            Default: I1..I13, log1p, nulls 0.
        categorical: 1 to 26 id columns, the model's categorical features in order (exactly these), each
            looking up its table (its own, or one it shares: ``table``); ``data.num_embeddings_per_feature``
            gives one size per column (columns sharing a table: the same size; ``auto``: the sum of their
            distinct ids), and the frequency threshold and the vocabulary apply as to Criteo's C1..C26.
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
        check_tables(self.categorical)

    @property
    def list_features(self) -> dict[int, int]:
        """Model feature index -> the most ids a row holds, for the list (multi-valued) columns."""
        return {j: c.max_length for j, c in enumerate(self.categorical) if c.max_length}

    @property
    def shared_tables(self) -> dict[str, list[int]]:
        """Table name -> the feature indices of the columns that look it up, for the tables of several columns."""
        columns: dict[str, list[int]] = {}
        for j, column in enumerate(self.categorical):
            columns.setdefault(column.table_name, []).append(j)
        return {table: features for table, features in columns.items() if len(features) > 1}

    def model_features(self) -> dict[str, Any] | None:
        """The model's inputs, as plain values (``model.features``): the dense columns' names and each
        categorical column's table, dim (None: ``model.embedding_dim``) and pooling, in input order.
        None for Criteo's own 13 + 26 columns, one table each (the default schema, however its ids are
        read): the model keeps Criteo's feature and table names, so that both roads train the same model."""
        criteo_tables = all(c.table is None and c.dim is None and c.pooling is None for c in self.categorical)
        names = (tuple(c.name for c in self.dense), tuple(c.name for c in self.categorical))
        if criteo_tables and names == (DENSE_NAMES, SPARSE_NAMES):
            return None
        settings = _table_settings(self.categorical)
        return {
            "dense": [column.name for column in self.dense],
            "categorical": [
                {"name": c.name, "table": c.table_name, **settings[c.table_name]} for c in self.categorical
            ],
        }

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


POOLINGS = ("sum", "mean")


def check_tables(columns: list[CategoricalColumn]) -> None:
    """Refuses a table setting that is not one (a dim not a positive integer, a pooling not sum or mean, a
    table name TorchRec cannot take), or columns sharing a table that read their ids differently."""
    for column in columns:
        where = f"data.schema.categorical {column.name!r}"
        if column.dim is not None and (isinstance(column.dim, bool) or not isinstance(column.dim, int) or column.dim < 1):
            raise ValueError(f"{where}: dim = {column.dim!r} must be a positive integer (unset: model.embedding_dim)")
        if column.dim is not None and column.dim % 4:  # TorchRec's sharder asserts it for FBGEMM's kernels
            raise ValueError(f"{where}: dim = {column.dim} must be a multiple of 4: FBGEMM's embedding kernels take widths in steps of 4")
        if column.pooling is not None and column.pooling not in POOLINGS:
            raise ValueError(f"{where}: pooling = {column.pooling!r} is not one of {', '.join(POOLINGS)}")
        if not column.table_name or "." in column.table_name:
            raise ValueError(f"{where}: table = {column.table_name!r} must be a name without '.' (a module name in the model)")
    first: dict[str, CategoricalColumn] = {}
    for column in columns:
        other = first.setdefault(column.table_name, column)
        if other.ids != column.ids:
            raise ValueError(
                f"data.schema.categorical {other.name!r} and {column.name!r} share table {column.table_name!r} but read "
                f"ids = {other.ids} and {column.ids}: a shared table needs one id space, so give both the same ids"
            )
    _table_settings(columns)


def _table_settings(columns: list[CategoricalColumn]) -> dict[str, dict[str, Any]]:
    """Table name -> its ``dim`` and ``pooling``: as one of its columns sets them (two that set different
    values are refused, naming both), else None and sum."""
    settings: dict[str, dict[str, Any]] = {}
    set_by: dict[tuple[str, str], CategoricalColumn] = {}
    for column in columns:
        table = settings.setdefault(column.table_name, {"dim": None, "pooling": None})
        for setting in ("dim", "pooling"):
            value = getattr(column, setting)
            if value is None:
                continue
            other = set_by.setdefault((column.table_name, setting), column)
            if table[setting] is not None and table[setting] != value:
                raise ValueError(
                    f"data.schema.categorical {other.name!r} and {column.name!r} share table {column.table_name!r} but set "
                    f"{setting} = {table[setting]!r} and {value!r}: set it once, or to the same value"
                )
            table[setting] = value
    for table in settings.values():
        table["pooling"] = table["pooling"] or "sum"
    return settings


def check_list_settings(schema: ParquetSchema, frequency_threshold: int) -> None:
    """Refuses a frequency threshold with list columns or shared tables, naming them: their ids are hashed
    into the table sizes (``auto``: the distinct ids seen, as for raw ids), not mapped by a vocabulary."""
    shared = schema.shared_tables
    if shared and frequency_threshold:
        table, features = next(iter(shared.items()))
        names = ", ".join(schema.categorical[j].name for j in features)
        raise ValueError(
            f"data.frequency_threshold = {frequency_threshold} does not apply to table {table!r} of data.schema, shared by "
            f"{names}: its ids are hashed into one table size; set data.frequency_threshold 0"
        )
    names = [c.name for c in schema.categorical if c.max_length]
    if not names:
        return
    if frequency_threshold:
        raise ValueError(
            f"data.frequency_threshold = {frequency_threshold} does not apply to the list columns of data.schema "
            f"({', '.join(names)}): their ids are hashed into the table sizes; set data.frequency_threshold 0"
        )
