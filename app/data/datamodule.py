"""The Criteo LightningDataModule: any Criteo format in, per-rank TorchRec batches out.

One road for every format (docs/data.md): raw TSV given to ``fit``, ``validate`` or ``test`` is
converted once into NumPy day files in a cache folder (:mod:`app.data.cache`, from
``prepare_data``), and every split is then read memory-mapped, so host memory per rank stays
bounded whatever the data size. Only ``predict`` reads raw TSV straight into memory (a file to
score, possibly unlabelled).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch.distributed as dist
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader

from app.data.cache import CacheRequest, cached_days, read_metadata
from app.data.dataset import CriteoBatches, EpochBatchSampler
from app.data.formats import DataFormat, ReadOptions, open_days, read_tsv_split, rows_view
from app.data.loader import ResumableBatchLoader
from app.data.numpy_days import NumpyDaysSource
from app.data.source import RowSource, expand_table_sizes
from app.data.splits import SPLITS_BY_STAGE, SplitFiles, SplitName, part_rows, split_files
from app.data.tsv import DenseTransform, OnBadRows

PathSpec = str | list[str]


class CriteoDataModule(LightningDataModule):
    """Reads Criteo click logs for every rank: raw TSV (plain or .gz), TorchRec's NumPy day files, or
    MLPerf's multi-hot day files.

    Raw TSV for fit, validate and test is converted once into NumPy day files in a cache folder
    (``cache_dir``) and read memory-mapped, like the preprocessed formats; a later run with the same
    files and options reuses the cache. Each step trains on one global batch of
    ``batch_size * world_size`` rows, split across the ranks; evaluation visits every row exactly
    once. Categorical ids are hashed modulo the table sizes.

    Args:
        train: training rows: a TSV file, a glob, a directory of ``.tsv``/``.txt``/``.gz`` files or a
            list of those; or a directory of preprocessed ``day_N_*.npy`` (or multi-hot) day files.
        val: validation rows (same forms as ``train``).
        test: test rows (same forms as ``train``).
        predict: rows to score; raw TSV may be unlabelled (39 fields, like Kaggle's ``test.txt``) and
            is read straight into memory, not cached.
        split: a standard split of the data at ``root`` instead of train/val/test: ``kaggle`` (7 equal
            days of train.txt: days 0-5 train, day 6 halves test then val) or ``terabyte`` (days 0-22
            train, day 23 halves val then test).
        root: the data of ``split``: Kaggle's train.txt (or its preprocessed folder), or the Terabyte
            folder of day_0..day_23 (raw, .gz, or preprocessed).
        format: ``auto`` (a folder of day_N_*.npy is numpy, of day_N_sparse_multi_hot.npz multi_hot,
            anything else raw TSV), or one of ``tsv``, ``numpy``, ``multi_hot``.
        batch_size: rows per batch on each process (the global batch is this times the world size).
        num_embeddings_per_feature: rows of each embedding table: 26 sizes, one size for all, or
            ``auto``: from the training data, the exact number of distinct ids per feature (or, for a
            folder preprocessed with a frequency threshold, its vocabulary sizes). Each categorical id
            is taken modulo its table's size.
        num_workers: DataLoader worker processes per rank that assemble batches.
        shuffle: reshuffle the training data every epoch: whole global batches in a new order (the
            rows of a batch stay contiguous on disk, so reads stay sequential at any scale); rows,
            for raw TSV read into memory.
        seed: seed of the training shuffle.
        on_bad_rows: ``error`` stops at the first malformed TSV row (naming file and line); ``skip``
            drops such rows, counts them and reports the count.
        dense_transform: raw TSV dense features become ``log1p`` = log(max(x, 0) + 1) (DLRM's) or
            ``log_plus_3`` = log(x + 3) (TorchRec's former NumPy preprocessing).
        cache_dir: where raw TSV is converted to NumPy day files, one sub-folder per input set.
            Default: a ``criteo_cache`` folder beside the raw files. Needs about 160 bytes per row
            (2/3 of the raw text).
        cache_workers: processes (and parse threads) converting raw TSV; default: the cores here.
        prepare_data_per_node: convert on local rank 0 of every node (true: node-local cache_dir),
            or only on global rank 0 (false: cache_dir on storage that every node sees).
    """

    def __init__(
        self,
        train: PathSpec | None = None,
        val: PathSpec | None = None,
        test: PathSpec | None = None,
        predict: PathSpec | None = None,
        split: SplitName | None = None,
        root: str | None = None,
        format: DataFormat = "auto",
        batch_size: int = 4096,
        num_embeddings_per_feature: int | list[int] | Literal["auto"] = 100_000,
        num_workers: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        on_bad_rows: OnBadRows = "error",
        dense_transform: DenseTransform = "log1p",
        cache_dir: str | None = None,
        cache_workers: int | None = None,
        prepare_data_per_node: bool = True,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"data.batch_size = {batch_size} must be at least 1")
        if num_workers < 0:
            raise ValueError(f"data.num_workers = {num_workers} must be >= 0")
        if cache_workers is not None and cache_workers < 1:
            raise ValueError(f"data.cache_workers = {cache_workers} must be at least 1")
        self.specs = {name: spec for name, spec in (("train", train), ("val", val), ("test", test), ("predict", predict)) if spec is not None}
        self.split, self.root, self.format = split, root, format
        self._check_split_settings()
        self.on_bad_rows, self.dense_transform = on_bad_rows, dense_transform
        self.cache_dir = None if cache_dir is None else Path(cache_dir).expanduser()
        self.cache_workers = cache_workers
        self.prepare_data_per_node = prepare_data_per_node
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.shuffle = shuffle
        self.seed = seed
        self.datasets: dict[str, CriteoBatches] = {}
        self.num_bad_rows_skipped = 0
        self._prepare_error: Exception | None = None
        # The model's tables take these sizes (app.cli links them once this module exists).
        self.table_sizes = self._table_sizes(num_embeddings_per_feature)
        self.options = ReadOptions(self.table_sizes, on_bad_rows, dense_transform)

    def _check_split_settings(self) -> None:
        if self.split is None:
            return
        if self.root is None:
            raise ValueError(f"data.split = {self.split} needs data.root, the folder or file holding the data")
        if any(name in self.specs for name in ("train", "val", "test")):
            raise ValueError("data.split replaces data.train/val/test: set one or the other")
        if not Path(self.root).expanduser().exists():
            raise FileNotFoundError(f"data.root: {self.root} does not exist")

    def _table_sizes(self, setting: int | list[int] | str) -> list[int]:
        if setting != "auto":
            return expand_table_sizes(setting, "data.num_embeddings_per_feature")  # type: ignore[arg-type]
        try:
            train = split_files(self.specs, self.split, self.root, self.format, ["train"])["train"]
        except ValueError:
            raise ValueError(
                "data.num_embeddings_per_feature: auto sizes the tables from the training data; set data.train or data.split"
            ) from None
        if train.format == "tsv":
            folder = cached_days(self._cache_request(train))  # now: the model is built from these sizes
        elif train.format == "numpy":
            folder = train.files[0]
        else:
            raise ValueError("data.num_embeddings_per_feature: auto needs raw TSV or app.data.preprocess's NumPy days, not multi_hot")
        metadata = read_metadata(folder)
        sizes = metadata.get("num_embeddings_per_feature") or metadata["distinct_ids_per_feature"]
        sizes = [max(1, int(size)) for size in sizes]
        rank_zero_info(f"data.num_embeddings_per_feature: auto -> {sizes} (from {folder / 'metadata.json'})")
        return sizes

    def _cache_request(self, files: SplitFiles) -> CacheRequest:
        return CacheRequest(files.files, self.dense_transform, self.on_bad_rows, self.cache_dir, self.cache_workers)

    def check_inputs(self, stage: str) -> None:
        """Raises FileNotFoundError naming the setting for an input of ``stage`` that does not exist.

        For the CLI to call before any worker starts (on global rank 0, which always reads the
        inputs); otherwise the error would come from ``prepare_data``, after the launch.
        """
        self._files(stage)

    def _files(self, stage: str) -> dict[str, SplitFiles]:
        return split_files(self.specs, self.split, self.root, self.format, SPLITS_BY_STAGE[stage])

    def prepare_data(self) -> None:
        """Convert the stage's raw TSV splits into the cache (Lightning calls this on local rank 0 of
        every node, or only on global rank 0, while the other ranks wait in a barrier)."""
        stage = self.trainer.state.fn.value if self.trainer is not None and self.trainer.state.fn else "fit"
        try:
            for name, files in self._files(stage).items():
                if files.format == "tsv" and name != "predict":
                    cached_days(self._cache_request(files))
        except Exception as error:
            # Raised from setup instead: leaving the barrier with an error would cut the waiting ranks
            # off mid-collective; in setup every rank stops with the message (app.data.cache).
            self._prepare_error = error

    def setup(self, stage: str) -> None:
        error, self._prepare_error = self._prepare_error, None
        if error is not None:
            raise error
        rank, world_size = self._rank_and_world_size()
        # Under a Trainer, prepare_data has converted (or failed to) before any rank gets here.
        convert = self.trainer is None
        reported: set[tuple[Path, ...]] = set()
        for name, files in self._files(stage).items():
            source, skipped, first_bad_row = self._open(name, files, convert)
            if skipped and files.files not in reported:
                reported.add(files.files)
                where = f"data.{name}" if files.setting == f"data.{name}" else f"{files.setting} ({files.files[0].name})"
                rank_zero_warn(f"{where}: skipped {skipped} malformed rows (data.on_bad_rows = skip); first: {first_bad_row}")
            if name == "train":
                self.num_bad_rows_skipped = skipped
            start, stop = part_rows(files.part, len(source))
            self.datasets[name] = self._rank_batches(name, rows_view(source, start, stop), rank, world_size)

    def _rank_and_world_size(self) -> tuple[int, int]:
        """This process's place: the Trainer's; outside one, the process group's (a plain training
        loop, e.g. the bench's, iterating this module's loaders); else a single process."""
        if self.trainer is not None:
            return self.trainer.global_rank, self.trainer.world_size
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1

    def _open(self, name: str, files: SplitFiles, convert: bool) -> tuple[RowSource, int, str | None]:
        """The rows of a split's files, with the number of malformed rows skipped and the first one."""
        if files.format != "tsv":
            return open_days(files.files[0], files.format, files.days, self.options), 0, None
        if name == "predict":
            arrays = read_tsv_split(files.files, self.options, labelled=None)
            return arrays, arrays.num_bad_rows, arrays.first_bad_row
        folder = cached_days(self._cache_request(files), convert)
        metadata = read_metadata(folder)
        unlabelled = [day["input"] for day in metadata["days"] if not day["labelled"]]
        if unlabelled:
            raise ValueError(f"data.{name}: {unlabelled[0]} has no label column (39 fields); only predict reads unlabelled rows")
        first = next((day["first_skipped_row"] for day in metadata["days"] if day["first_skipped_row"]), None)
        source = NumpyDaysSource.from_directory(folder, None, self.table_sizes)
        return source, int(metadata["skipped_rows"]), first

    def _rank_batches(self, split: str, source: RowSource, rank: int, world_size: int) -> CriteoBatches:
        is_train = split == "train"
        if is_train and len(source) < world_size:
            raise ValueError(f"data.train has {len(source)} rows, fewer than the {world_size} processes")
        if len(source) == 0:
            raise ValueError(f"data.{split} has no rows")
        return CriteoBatches(
            source,
            batch_size_per_rank=self.batch_size,
            rank=rank,
            world_size=world_size,
            shuffle=is_train and self.shuffle,
            seed=self.seed,
            drop_remainder=is_train,
        )

    def _loader(self, split: str) -> DataLoader:
        return ResumableBatchLoader(self.datasets[split], num_workers=self.num_workers)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train")

    def val_dataloader(self) -> DataLoader | list:
        return self._loader("val") if "val" in self.datasets else []

    def test_dataloader(self) -> DataLoader:
        return self._loader("test")

    def predict_dataloader(self) -> DataLoader:
        # A plain DataLoader: Lightning rebuilds the predict loader to track batch indices, and
        # nothing needs resuming there.
        dataset = self.datasets["predict"]
        return DataLoader(dataset, batch_size=None, sampler=EpochBatchSampler(len(dataset)), num_workers=self.num_workers)
