"""The Criteo LightningDataModule: any Criteo format in, per-rank TorchRec batches out.

One road for every format (docs/data.md): raw TSV given to ``fit``, ``validate`` or ``test`` is
converted once into NumPy day files in a cache folder (:mod:`app.data.cache`, at the start of
``setup``, by one rank per node or one in all), and every split is then read memory-mapped, so host memory per rank stays
bounded whatever the data size. Only ``predict`` reads raw TSV straight into memory (a file to
score, possibly unlabelled).

This module wires the data road's parts together, each in its own module: which files each split
reads (:mod:`app.data.splits`), the tables' sizes (:mod:`app.data.table_sizes`), the conversion by
the converting ranks behind the strategy's barrier (:mod:`app.data.conversion`) and the vocabulary of
``data.frequency_threshold`` as checkpoint state (:mod:`app.data.vocabulary_state`). A checkpoint
carries its table sizes and vocabulary: scoring or resuming it reads neither the training data nor
its cache (the CLI sets both from the checkpoint before this module is set up).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist
from lightning.pytorch import LightningDataModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader

from app.data.cache import CacheRequest, cached_days, read_metadata
from app.data.conversion import conversion_wait_s, convert_on_converting_ranks
from app.data.dataset import CriteoBatches, EpochBatchSampler
from app.data.formats import DataFormat, ReadOptions, open_days, read_tsv_split, rows_view
from app.data.layout import DATA_LAYOUT_KEY, training_layout
from app.data.frequency_threshold import mapped_days, training_vocabulary
from app.data.loader import ResumableBatchLoader, ignore_preemption_signals
from app.data.numpy_days import NumpyDaysSource
from app.data.parquet.groups import split_groups
from app.data.parquet.jagged_source import JaggedDaysSource
from app.data.parquet.keys import check_key_columns, read_key_columns
from app.data.parquet.model_inputs import ModelInputs, counted_table_sizes as counted_schema_sizes, set_table_sizes
from app.data.parquet.schema import ParquetSchema, check_list_settings
from app.data.parquet.statistics import STATISTICS_KEY, DenseStatistics, check_restored_statistics, standardized_columns, training_statistics
from app.data.preprocess import RAW_IDS, Vocabulary
from app.data.source import RowSource
from app.data.splits import SPLITS_BY_STAGE, SplitFiles, SplitName, part_rows, split_files
from app.data.table_sizes import SETTING as TABLE_SIZES_SETTING
from app.data.table_sizes import CACHED_FORMATS, TableSizeSetting, sizes_as_set, sizes_from_days, sizes_from_vocabulary
from app.data.tsv import CriteoArrays, DenseTransform, OnBadRows
from app.data.vocabulary_coverage import DEFAULT_WARN_SHARE, OutsideCounts, check_warn_share, from_metadata, report
from app.data.vocabulary_state import VocabularyState, warn_about_small_tables

PathSpec = str | list[str]


class CriteoDataModule(LightningDataModule):
    """Reads Criteo click logs for every rank: raw TSV (plain or .gz), TorchRec's NumPy day files, or
    MLPerf's multi-hot day files.

    Raw TSV for fit, validate and test is converted once into NumPy day files in a cache folder
    (``cache_dir``) and read memory-mapped, like the preprocessed formats; a later run with the same
    files and options reuses the cache. Each step trains on one global batch of
    ``batch_size * world_size`` rows, split across the ranks; evaluation visits every row exactly
    once. Categorical ids are hashed modulo the table sizes (after ``frequency_threshold``'s mapping).

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
            ``.parquet`` files parquet, anything else raw TSV), or one of ``tsv``, ``numpy``,
            ``multi_hot``, ``parquet``.
        batch_size: rows per batch on each process (the global batch is this times the world size).
        num_embeddings_per_feature: rows of each embedding table: 26 sizes, one size for all, or
            ``auto``: from the training data, the exact number of distinct ids per feature (with
            ``frequency_threshold``, or for a folder preprocessed with one, its vocabulary sizes + 2).
            Each categorical id is taken modulo its table's size: with a threshold, a table smaller
            than its vocabulary + 2 makes kept ids share rows (warned). ``auto`` is counted in
            ``setup``, on the converting ranks behind the strategy's barrier; with ``--ckpt_path`` the
            sizes are the checkpoint's.
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
            (2/3 of the raw text); with ``frequency_threshold`` also 104 bytes per row for the
            mapped ids and 8 bytes per kept id for the vocabulary.
        cache_workers: processes (and parse threads) converting raw TSV; default: the cores here.
        prepare_data_per_node: convert on local rank 0 of every node (true: for a node-local
            cache_dir), or only on global rank 0 (false: for a cache_dir on storage that every node
            sees). A lock file beside each cache folder lets one process convert it at a time, so
            true on shared storage converts once too: the other nodes wait for the first and find it
            done (up to the strategy's barrier_timeout_s).
        frequency_threshold: 0: off (ids as they are). T >= 1: ids seen at least T times in the
            training split get their own contiguous ids 2, 3, ... per feature, every other id (rare,
            or unseen in training) the shared id 1, as TorchRec's Criteo preprocessing and the DLRM
            references do (they use T = 3). Counted once over the cached training rows (only
            those); validation and test are cached mapped with that vocabulary; ``predict`` maps
            with the vocabulary saved in the checkpoint or exported model it scores with. Raw TSV
            only. With ``--ckpt_path`` every split is mapped with the checkpoint's vocabulary (and its
            threshold is taken); without one, validate and test count it over ``train`` (or ``split``).
        out_of_vocabulary_warn_share: with ``frequency_threshold``, every split but ``train`` is reported
            with each feature's share of ids outside the vocabulary (mapped to the shared id 1), and a
            warning names the features whose share is above this (0 .. 1; 1: never): rows from another
            source than the training data, whose ids the model does not know. The default, 0.9, lies
            between held-out rows of the training data and rows of another source (measured in
            app/data/vocabulary_coverage.py).
        schema: for ``format: parquet`` (or ``.parquet`` files under ``auto``): which columns are the label,
            the dense and the categorical features (the model's inputs, exactly these: their tables, shared
            or not, dims and pooling), and how each is read (docs/own-data.md).
            Default: Criteo's column names, as ``python -m app.data.to_parquet`` writes them. Parquet is
            converted into the cache like raw TSV (also for ``predict``), so every other setting applies.
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
        num_embeddings_per_feature: TableSizeSetting = 100_000,
        num_workers: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        on_bad_rows: OnBadRows = "error",
        dense_transform: DenseTransform = "log1p",
        cache_dir: str | None = None,
        cache_workers: int | None = None,
        prepare_data_per_node: bool = True,
        frequency_threshold: int = 0,
        out_of_vocabulary_warn_share: float = DEFAULT_WARN_SHARE,
        schema: ParquetSchema | None = None,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"data.batch_size = {batch_size} must be at least 1")
        if num_workers < 0:
            raise ValueError(f"data.num_workers = {num_workers} must be >= 0")
        if cache_workers is not None and cache_workers < 1:
            raise ValueError(f"data.cache_workers = {cache_workers} must be at least 1")
        self.vocabulary_state = VocabularyState(frequency_threshold)
        self.frequency_threshold = frequency_threshold
        self.out_of_vocabulary_warn_share = check_warn_share(out_of_vocabulary_warn_share)
        self._unmapped_predict: CriteoArrays | None = None  # predict's raw ids, until a vocabulary maps them
        self._predict_place = (0, 1)  # (rank, world size) of the predict rows still to be mapped
        self.specs = {name: spec for name, spec in (("train", train), ("val", val), ("test", test), ("predict", predict)) if spec is not None}
        self.split, self.root, self.format = split, root, format
        self.schema = schema if schema is not None else ParquetSchema()
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
        # Each evaluation split's group id per row (by row id), with data.schema.group: for GAUC.
        self.eval_groups: dict[str, np.ndarray] = {}
        self.num_bad_rows_skipped = 0
        # data.schema's standardize columns: the training rows' [mean, std] each, counted or a checkpoint's.
        self.dense_statistics: DenseStatistics | None = None
        # The features the model is trained on and how each is made (app/data/layout.py): set by a fit's
        # setup, kept in its checkpoints for what reads them without the data (the pt2 export).
        self.training_layout: dict[str, Any] | None = None
        # The model's tables take these sizes (app.cli links them once this module exists); None with
        # `auto` until setup has read the training data (the model then builds its tables in its setup).
        self.table_sizes: list[int] | None = self._sizes_as_set(num_embeddings_per_feature)
        if self.table_sizes is None and not (self.specs.get("train") or self.split):
            raise ValueError(f"{TABLE_SIZES_SETTING}: auto sizes the tables from the training data; set data.train or data.split")

    def _sizes_as_set(self, setting: TableSizeSetting) -> list[int] | None:
        """The 26 sizes of the cached id columns that a size setting names (None: ``auto``): Criteo's, or
        one per categorical column of ``data.schema`` (the cache's other id columns: 1)."""
        if setting == "auto" or self.model_features is None:
            return sizes_as_set(setting)
        return set_table_sizes(self.schema, setting)  # type: ignore[arg-type]

    @property
    def model_features(self) -> dict[str, Any] | None:
        """The model's inputs that ``data.schema`` names (``model.features``); None: Criteo's 13 + 26."""
        return self.schema.model_features()

    @property
    def model_table_sizes(self) -> list[int] | None:
        """One table size per categorical feature of the model (``model.num_embeddings_per_feature``)."""
        features = self.model_features
        if self.table_sizes is None or features is None:
            return self.table_sizes
        return self.table_sizes[: len(features["categorical"])]

    @property
    def options(self) -> ReadOptions:
        """How rows are read: ids modulo the table sizes (known once setup has sized them)."""
        assert self.table_sizes is not None, "the table sizes are known once setup has read the training data"
        return ReadOptions(self.table_sizes, self.on_bad_rows, self.dense_transform)

    def _check_split_settings(self) -> None:
        if self.split is None:
            return
        if self.root is None:
            raise ValueError(f"data.split = {self.split} needs data.root, the folder or file holding the data")
        if any(name in self.specs for name in ("train", "val", "test")):
            raise ValueError("data.split replaces data.train/val/test: set one or the other")
        if not Path(self.root).expanduser().exists():
            raise FileNotFoundError(f"data.root: {self.root} does not exist")

    def _cache_request(self, files: SplitFiles, convert: bool = False) -> CacheRequest:
        """How ``files`` are cached; Parquet's conversion standardises with the training rows' statistics
        (counted first where ``convert``), which are then part of the cache's fingerprint."""
        schema = self.schema.as_dict() if files.format == "parquet" else None
        if schema is not None and standardized_columns(self.schema):
            schema[STATISTICS_KEY] = self._dense_statistics(convert)
        return self._request_with(files, schema)

    def _request_with(self, files: SplitFiles, schema: dict[str, Any] | None) -> CacheRequest:
        return CacheRequest(
            files.files, self.dense_transform, self.on_bad_rows, self.cache_dir, self.cache_workers,
            wait_s=conversion_wait_s(self.trainer), parquet_schema=schema,
        )

    def _dense_statistics(self, convert: bool) -> DenseStatistics:
        """standardize's statistics: the restored checkpoint's, else the training files' (counted once)."""
        if self.dense_statistics is None:
            train = self._statistics_split()
            request = self._request_with(train, self.schema.as_dict())  # the files' own fingerprint
            self.dense_statistics = training_statistics(request, self.schema, convert)
        return self.dense_statistics

    def _statistics_split(self) -> SplitFiles:
        """The training files standardize's statistics are counted over: whole Parquet files."""
        names = ", ".join(column.name for column in standardized_columns(self.schema))
        why = f"data.schema.dense ({names}): transform standardize takes its mean and std from the training rows"
        try:
            train = split_files(self.specs, self.split, self.root, self.format, ["train"])["train"]
        except ValueError:
            raise ValueError(f"{why}: set data.train for this stage too, or give --ckpt_path (it holds them)") from None
        if train.format != "parquet" or train.part != "all":
            raise ValueError(f"{why}, of whole Parquet files: {train.setting} is {train.format} ({train.part} rows)")
        return train

    def _check_threshold_applies(self, files: SplitFiles) -> None:
        if files.format in CACHED_FORMATS:
            return
        where, threshold = files.setting, self.frequency_threshold
        if files.format == "multi_hot":
            raise ValueError(
                f"data.frequency_threshold = {threshold} does not apply to multi-hot days ({where}): their ids are "
                "already hashed into MLPerf's table sizes; leave it at 0"
            )
        raise ValueError(
            f"data.frequency_threshold = {threshold} counts raw TSV ids as they are cached; {where} is a folder of "
            f"NumPy days, whose ids were fixed when it was preprocessed: make it from the raw TSV with "
            f"`python -m app.data.preprocess --frequency_threshold {threshold}` (num_embeddings_per_feature: auto "
            "then follows its vocabulary), or read the raw TSV here, and leave data.frequency_threshold at 0"
        )

    def _needs_training_data(self, stage: str) -> bool:
        """Whether ``stage`` reads data.train beyond its own splits: to size `auto` tables, or to count the
        vocabulary its splits are mapped with when no checkpoint brought one."""
        counts_vocabulary = self.frequency_threshold and self.vocabulary_state.restored is None and stage in ("validate", "test")
        return self.table_sizes is None or bool(counts_vocabulary)

    def _training_split(self) -> SplitFiles:
        try:
            train = split_files(self.specs, self.split, self.root, self.format, ["train"])["train"]
        except ValueError:
            why = (f"{TABLE_SIZES_SETTING}: auto sizes the tables from the training data" if self.table_sizes is None else
                   f"data.frequency_threshold = {self.frequency_threshold} maps ids with the vocabulary counted over data.train")
            raise ValueError(f"{why}: set data.train (or data.split) for this stage too, or give --ckpt_path") from None
        if self.frequency_threshold:
            self._check_threshold_applies(train)
        return train

    def _vocabulary(self, convert: bool) -> Vocabulary:
        """The vocabulary the ids are mapped with: the restored checkpoint's, else the training split's
        (counted once, then read from the cache)."""
        state = self.vocabulary_state
        if state.vocabulary is None:
            train = self._training_split()
            where = train.setting if train.part == "all" else f"{train.setting} ({train.part} rows)"
            request = self._cache_request(train, convert)
            state.counted = training_vocabulary(request, train.part, self.frequency_threshold, where, convert)
        assert state.vocabulary is not None
        return state.vocabulary

    def _cached_folder(self, files: SplitFiles, convert: bool) -> Path:
        """The cached days of a raw TSV split: as converted, or mapped with the vocabulary."""
        request = self._cache_request(files, convert)
        if not self.frequency_threshold:
            return cached_days(request, convert)
        self._vocabulary(convert)
        return mapped_days(request, self.vocabulary_state.in_cache(request.folder.parent, write=convert), convert)

    def _size_tables(self, convert: bool) -> None:
        """Sets `auto` table sizes from the training data (its vocabulary, or its cached days' metadata)."""
        if self.table_sizes is not None:
            return
        train = self._training_split()
        if self.frequency_threshold:
            self.table_sizes = sizes_from_vocabulary(self._vocabulary(convert))
            rank_zero_info(f"{TABLE_SIZES_SETTING}: auto -> {self.table_sizes} (the vocabulary sizes + 2)")
            return
        folder = cached_days(self._cache_request(train, convert), convert) if train.format in CACHED_FORMATS else None
        self.table_sizes, source = sizes_from_days(train, folder)
        if train.format == "parquet":  # a table shared by several columns covers all their ids
            self.table_sizes = counted_schema_sizes(self.schema, self.table_sizes)
        rank_zero_info(f"{TABLE_SIZES_SETTING}: auto -> {self.table_sizes} (from {source})")

    def check_inputs(self, stage: str) -> None:
        """Raises FileNotFoundError naming the setting for an input of ``stage`` that does not exist.

        For the CLI to call before any worker starts (on global rank 0, which always reads the
        inputs); otherwise the error would come from ``setup``, after the launch.
        """
        self._files(stage)
        if self._needs_training_data(stage):
            self._training_split()  # where the sizes or the vocabulary come from: named before any launch
        if self.dense_statistics is None and standardized_columns(self.schema):
            self._statistics_split()  # where standardize's statistics come from: named before any launch

    def _files(self, stage: str) -> dict[str, SplitFiles]:
        """The files of the splits ``stage`` reads that are set, refusing a threshold where it cannot apply."""
        found = split_files(self.specs, self.split, self.root, self.format, SPLITS_BY_STAGE[stage])
        if self.frequency_threshold:
            for files in found.values():
                self._check_threshold_applies(files)
        if any(files.format == "parquet" for files in found.values()):
            check_list_settings(self.schema, self.frequency_threshold)
        other = next((files for files in found.values() if files.format != "parquet"), None)
        if other is not None and self.model_features is not None:
            raise ValueError(f"data.schema names Parquet columns, but {other.setting} holds {other.format} files: drop data.schema")
        return found

    def _convert(self, stage: str) -> None:
        """Caches every raw TSV split ``stage`` reads (predict reads its file directly), and what sizing
        the tables needs."""
        self._size_tables(convert=True)
        for name, files in self._files(stage).items():
            if files.format in CACHED_FORMATS and (name != "predict" or files.format == "parquet"):
                self._cached_folder(files, convert=True)

    def setup(self, stage: str) -> None:
        if self.trainer is not None:
            # The one conversion road: the converting ranks convert while the others wait at the barrier.
            convert_on_converting_ranks(self.trainer, self.prepare_data_per_node, lambda: self._convert(stage))
        # Under a Trainer the converting ranks have converted (or failed to) before any rank gets here.
        convert = self.trainer is None
        self._size_tables(convert)
        rank, world_size = self._rank_and_world_size()
        reported: set[tuple[Path, ...]] = set()
        for name, files in self._files(stage).items():
            source, skipped, first_bad_row = self._open(name, files, convert)
            if skipped and files.files not in reported:
                reported.add(files.files)
                where = f"data.{name}" if files.setting == f"data.{name}" else f"{files.setting} ({files.files[0].name})"
                rank_zero_warn(f"{where}: skipped {skipped} malformed rows (data.on_bad_rows = skip); first: {first_bad_row}")
            if name == "train":
                self.num_bad_rows_skipped = skipped
                self.training_layout = training_layout(files.format, files.files, self.schema, self.dense_transform)
            start, stop = part_rows(files.part, len(source))
            if name == "predict" and self.frequency_threshold and files.format == "tsv":  # Parquet's is cached mapped
                # Raw ids until the vocabulary is known: a checkpoint's may arrive after setup (load_state_dict).
                self._unmapped_predict, self._predict_place = source, (rank, world_size)  # type: ignore[assignment]
                continue
            self.datasets[name] = self._rank_batches(name, rows_view(source, start, stop), rank, world_size)
            if name == "predict" and files.format == "parquet" and self.schema.key_columns:
                check_key_columns(files.files, self.schema.key_columns)  # before predicting, not after
            if name in ("val", "test") and files.format == "parquet" and self.schema.group is not None:
                raw_days = self._cache_request(files).folder  # the groups are not mapped: beside the raw ids
                self.eval_groups[name] = split_groups(raw_days, len(files.files), start, stop)
        if self.frequency_threshold and self.vocabulary_state.vocabulary is not None:
            warn_about_small_tables(self.vocabulary_state.vocabulary, self.table_sizes)

    def predict_keys(self) -> dict[str, list[str]] | None:
        """The predict rows' ``data.schema.key_columns`` as text, in row order (None: none set), for
        predictions.tsv; read from the Parquet files when the predictions are written (on rank 0)."""
        files = split_files(self.specs, None, None, self.format, ["predict"])["predict"]
        if files.format != "parquet" or not self.schema.key_columns:
            return None
        return read_key_columns(files.files, self.schema.key_columns)

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
        if files.format not in CACHED_FORMATS:
            return open_days(files.files[0], files.format, files.days, self.options), 0, None
        if name == "predict" and files.format == "tsv":
            # With a threshold: the raw 32-bit ids, mapped once a vocabulary is known (predict_dataloader).
            options = ReadOptions(RAW_IDS, self.on_bad_rows, self.dense_transform) if self.frequency_threshold else self.options
            arrays = read_tsv_split(files.files, options, labelled=None)
            return arrays, arrays.num_bad_rows, arrays.first_bad_row
        folder = self._cached_folder(files, convert)
        metadata = read_metadata(folder)
        unlabelled = [day["input"] for day in metadata["days"] if not day["labelled"]]
        if unlabelled and name != "predict":
            raise ValueError(f"data.{name}: {unlabelled[0]} has no label column (39 fields); only predict reads unlabelled rows")
        first = next((day["first_skipped_row"] for day in metadata["days"] if day["first_skipped_row"]), None)
        if files.format == "parquet" and self.schema.list_features:
            source = JaggedDaysSource.from_directory(folder, None, self.table_sizes, list_features=list(self.schema.list_features))
        else:
            source = NumpyDaysSource.from_directory(folder, None, self.table_sizes)
        if files.format == "parquet" and (features := self.model_features) is not None:
            source = ModelInputs(source, len(features["dense"]), [c["name"] for c in features["categorical"]])
        outside = from_metadata(metadata, *part_rows(files.part, len(source))) if name != "train" else None
        if outside is not None:  # counted as the split's days were mapped (app/data/vocabulary_coverage.py)
            where = f"data.{name}" if files.setting == f"data.{name}" else f"{files.setting} ({files.part} rows)"
            report(where, outside, self.frequency_threshold, self.out_of_vocabulary_warn_share)
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
        self._check_restored_ids(same_vocabulary=True)
        return ResumableBatchLoader(self.datasets[split], num_workers=self.num_workers)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train")

    def val_dataloader(self) -> DataLoader | list:
        return self._loader("val") if "val" in self.datasets else []

    def test_dataloader(self) -> DataLoader:
        return self._loader("test")

    def predict_dataloader(self) -> DataLoader:
        self._check_restored_ids(same_vocabulary=False)
        if self._unmapped_predict is not None:
            self._map_predict_ids()
        # A plain DataLoader: Lightning rebuilds the predict loader to track batch indices, and
        # nothing needs resuming there.
        dataset = self.datasets["predict"]
        return DataLoader(
            dataset, batch_size=None, sampler=EpochBatchSampler(len(dataset)), num_workers=self.num_workers,
            worker_init_fn=ignore_preemption_signals,  # as the other loaders' workers (app.data.loader)
        )

    # ---- the vocabulary as checkpoint state (app/data/vocabulary_state.py) -------------------

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of this module: the threshold and its vocabulary (none without a
        threshold), and the training data's layout. app.checkpoint writes the vocabulary's arrays beside
        the checkpoint's metadata."""
        state = self.vocabulary_state.state_dict()
        if self.training_layout is not None:
            state[DATA_LAYOUT_KEY] = self.training_layout
        if self.dense_statistics is not None:  # standardize's: scoring the checkpoint needs no training rows
            state[STATISTICS_KEY] = self.dense_statistics
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Takes a checkpoint's threshold and vocabulary (a :class:`Vocabulary`, or its plain form from an
        exported model file). Before ``setup`` it maps every split of the run; after, it is checked
        against the vocabulary the splits were mapped with when the loaders are made."""
        if "frequency_threshold" in state_dict:  # a checkpoint without a threshold holds other state only
            self.vocabulary_state.load_state_dict(state_dict)
        if STATISTICS_KEY in state_dict:
            self.dense_statistics = check_restored_statistics(state_dict[STATISTICS_KEY], self.dense_statistics, self.schema)

    def _check_restored_ids(self, same_vocabulary: bool) -> None:
        path = None if self.trainer is None else self.trainer.ckpt_path
        if path is not None:
            self.vocabulary_state.check_restored(path, same_vocabulary)

    def _map_predict_ids(self) -> None:
        """Maps predict's raw ids with the vocabulary (the restored checkpoint's, or with no checkpoint the
        training split's, if this process has it)."""
        arrays, (rank, world_size) = self._unmapped_predict, self._predict_place
        assert arrays is not None and self.table_sizes is not None
        outside = self.vocabulary_state.map_raw_ids(arrays.sparse, self.table_sizes)
        # Every rank holds all rows until _rank_batches: rank 0's report covers them all.
        counts = OutsideCounts.of(len(arrays), outside)
        report("data.predict", counts, self.frequency_threshold, self.out_of_vocabulary_warn_share)
        self._unmapped_predict = None
        self.datasets["predict"] = self._rank_batches("predict", arrays, rank, world_size)


def counted_table_sizes(trainer: Trainer) -> list[int]:
    """The table sizes the run's data module counted in its setup (``auto``), for a model whose tables
    waited for them."""
    datamodule = trainer.datamodule
    sizes = datamodule.model_table_sizes if isinstance(datamodule, CriteoDataModule) else None
    if sizes is None:
        raise ValueError("model.num_embeddings_per_feature: not set, and no data module counted the table sizes")
    return list(sizes)
