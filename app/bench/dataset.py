"""A real Criteo dataset as the bench's input instead of random batches, read through the app's own
``CriteoDataModule``: both sides train on the batches ``python -m app fit`` would train on.

The data is prepared once, in the parent process, before any worker starts: raw TSV is converted
into its NumPy cache, ``auto`` table sizes are resolved and one batch is read for its shape. So no
conversion is ever timed, and a bad path or format is refused before any process starts. Every
worker then builds the same data module with the resolved table sizes and only opens the cache.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torch.utils.data import DataLoader

from app.bench.data import batch_bytes
from app.criteo import NUM_DENSE
from app.data.datamodule import CriteoDataModule
from app.data.partition import num_batches

# The bench trains only, on one node: no evaluation splits, and the parent prepares the data.
SKIPPED_SETTINGS = {"val", "test", "predict", "prepare_data_per_node"}
# Either of these makes a dataset the input; without one, the batches are random.
SOURCE_SETTINGS = ("train", "split")

GROUP_TITLE = "A Criteo dataset instead of the random batches (the app's CriteoDataModule)"
GROUP_DESCRIPTION = (
    "The settings of python -m app fit --data.*; set dataset.train, or dataset.split with "
    "dataset.root, to use them. Both sides then train on the same batches of the data module, in "
    "the same order, epoch after epoch when the data has fewer batches than the run's steps. Tables "
    "are dataset.num_embeddings_per_feature (auto: from the data), the batch size per rank is "
    "dataset.batch_size, and the data.* settings are ignored. Raw TSV is converted into its NumPy "
    "cache once, before any process starts, and never timed."
)

_PARAMETERS = inspect.signature(CriteoDataModule.__init__).parameters
# The data module's messages name its settings as the app's CLI does (data.train); here they are dataset.*.
_SETTING_NAMES = "|".join(name for name in _PARAMETERS if name != "self")
_SETTING_IN_MESSAGE = re.compile(rf"(?<![\w/.~-])data\.({_SETTING_NAMES})\b")  # not a file name such as /x/data.train
# Bytes per row of a NumPy day file besides its ids: 13 float32 dense features and an int32 label.
_STORED_BYTES_PER_ROW = NUM_DENSE * 4 + 4
_STORED_BYTES_PER_ID = 4  # int32, as app.data.preprocess (the TSV cache) and MLPerf's multi-hot days store ids


@dataclass
class DatasetInput:
    """A dataset the bench trains on: its settings, and what reading it in the parent found.

    Args:
        settings: CriteoDataModule's arguments as given (``dataset.*``).
        table_sizes: the 26 table sizes the data module resolved (``auto``: read from the data).
        ids_per_lookup: ids per lookup of each table, averaged over the first batch: 1 for raw TSV
            and NumPy days, the bag sizes for multi-hot days.
        rows: training rows.
        batches_per_epoch: batches per rank in one pass over the rows (the last may be short).
    """

    settings: dict[str, Any]
    table_sizes: list[int]
    ids_per_lookup: list[float]
    rows: int
    batches_per_epoch: int

    @property
    def batch_size_per_rank(self) -> int:
        return int(self.settings["batch_size"])

    def table_rows(self) -> list[int]:
        return list(self.table_sizes)

    def table_setting(self) -> str:
        """The setting that sized the tables, for messages."""
        return f"dataset.num_embeddings_per_feature = {self.settings['num_embeddings_per_feature']}"

    def batch_bytes(self) -> int:
        return batch_bytes(self.batch_size_per_rank, self.ids_per_lookup)

    def pooling_factors(self) -> list[float]:
        return list(self.ids_per_lookup)

    def mapped_data_bytes(self, steps: int) -> int:
        """Bytes of the day files one rank reads in ``steps`` steps: memory-mapped, they count in its
        resident memory. An estimate from the stored layout (TorchRec's int64 days hold more)."""
        rows = min(steps, self.batches_per_epoch) * self.batch_size_per_rank
        return int(rows * (_STORED_BYTES_PER_ROW + _STORED_BYTES_PER_ID * sum(self.ids_per_lookup)))

    def shape(self) -> dict[str, Any]:
        """What the run line records besides the settings."""
        return {
            "rows": self.rows, "batches_per_epoch_per_rank": self.batches_per_epoch,
            "table_sizes": self.table_sizes, "ids_per_lookup": self.ids_per_lookup,
        }  # fmt: skip


def dataset_settings(given: dict[str, Any]) -> dict[str, Any] | None:
    """The ``dataset.*`` settings when they name a dataset (dataset.train or dataset.split), else
    None; a ValueError for dataset settings given without one (they would silently do nothing)."""
    if any(given.get(name) is not None for name in SOURCE_SETTINGS):
        return dict(given)
    changed = [name for name, value in given.items() if value != _PARAMETERS[name].default]
    if changed:
        raise ValueError(
            f"dataset.{changed[0]} is set, but no dataset.train or dataset.split: set one of those to "
            "train on a dataset, or leave dataset.* out for random batches"
        )
    return None


def read_dataset(settings: dict[str, Any], world_size: int) -> DatasetInput:
    """Prepares the dataset (raw TSV: its cache) and reads its shape; a ValueError naming the
    ``dataset.*`` setting and the file for anything the data module refuses."""
    try:
        # The converter reports on stdout, which is the bench's JSON lines: its report goes to stderr.
        with contextlib.redirect_stdout(sys.stderr):
            data = CriteoDataModule(**settings)
            data.setup("fit")  # no Trainer, no process group: converts raw TSV, then one rank, all the rows
        train = data.datasets["train"]
        first = train[(0, 0)]
    except (ValueError, FileNotFoundError) as error:
        raise ValueError(_in_bench_terms(str(error), settings)) from None
    rows, batch_size = len(train.source), int(settings["batch_size"])
    if rows < batch_size * world_size:  # every step would train fewer rows than asked for
        raise ValueError(
            f"{_source_setting(settings)} has {rows} training rows, fewer than one global batch of dataset.batch_size "
            f"= {batch_size} x run.world_size = {world_size}: lower dataset.batch_size"
        )
    lengths = first.sparse_features.lengths().view(len(data.table_sizes), -1).double()
    return DatasetInput(
        settings=dict(settings),
        table_sizes=list(data.table_sizes),
        ids_per_lookup=lengths.mean(dim=1).tolist(),
        rows=rows,
        batches_per_epoch=num_batches(rows, batch_size, world_size, drop_remainder=True),
    )


def _in_bench_terms(message: str, settings: dict[str, Any]) -> str:
    """The data module's message naming ``dataset.*`` settings; one that names only a file (a day
    file opened in set-up) gets the setting that led there."""
    renamed = _SETTING_IN_MESSAGE.sub(r"dataset.\1", message)
    if "dataset." in renamed:
        return renamed
    return f"{_source_setting(settings)}: {renamed}"


def _source_setting(settings: dict[str, Any]) -> str:
    return "dataset.root" if settings.get("split") else "dataset.train"


def open_dataset(dataset: DatasetInput) -> CriteoDataModule:
    """The data module in a worker: the resolved table sizes, so that ``auto`` is not read again."""
    return CriteoDataModule(**{**dataset.settings, "num_embeddings_per_feature": dataset.table_sizes})


def epochs(loader: DataLoader) -> Iterator[Any]:
    """A loader's batches, epoch after epoch, each epoch told to its sampler as Lightning tells it
    (``set_epoch``: the shuffle order), so that a plain loop sees the batches the Trainer sees."""
    for epoch in itertools.count():
        loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        yield from loader
