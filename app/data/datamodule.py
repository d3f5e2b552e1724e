"""The Criteo LightningDataModule: any Criteo format in, per-rank TorchRec batches out."""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader

from app.data.dataset import CriteoBatches, EpochBatchSampler
from app.data.formats import DataFormat, ReadOptions, detect_format, open_split
from app.data.loader import ResumableBatchLoader
from app.data.source import RowSource
from app.data.splits import SplitName, named_split
from app.data.tsv import expand_paths
from app.data.tsv import DenseTransform, OnBadRows
from app.model.tables import expand_table_sizes

PathSpec = str | list[str]

_SPLITS_BY_STAGE = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",), "predict": ("predict",)}


class CriteoDataModule(LightningDataModule):
    """Reads Criteo click logs for every rank: raw TSV (plain or .gz), TorchRec's NumPy day files, or
    MLPerf's multi-hot day files.

    Each step trains on one global batch of ``batch_size * world_size`` rows, split across the ranks;
    evaluation visits every row exactly once. Categorical ids are hashed modulo the table sizes.

    Args:
        train: training rows: a TSV file, a glob, a directory of ``.tsv``/``.txt``/``.gz`` files or a
            list of those; or a directory of preprocessed ``day_N_*.npy`` (or multi-hot) day files.
        val: validation rows (same forms as ``train``).
        test: test rows (same forms as ``train``).
        predict: rows to score; raw TSV may be unlabelled (39 fields, like Kaggle's ``test.txt``).
        split: a standard split of the data at ``root`` instead of train/val/test: ``kaggle`` (7 equal
            days of train.txt: days 0-5 train, day 6 halves test then val) or ``terabyte`` (days 0-22
            train, day 23 halves val then test).
        root: the data of ``split``: Kaggle's train.txt (or its preprocessed folder), or the Terabyte
            folder of day_0..day_23 (raw, .gz, or preprocessed).
        format: ``auto`` (a folder of day_N_*.npy is numpy, of day_N_sparse_multi_hot.npz multi_hot,
            anything else raw TSV), or one of ``tsv``, ``numpy``, ``multi_hot``.
        batch_size: rows per batch on each process (the global batch is this times the world size).
        num_embeddings_per_feature: rows of each embedding table: 26 sizes, or one size for all; each
            categorical id is taken modulo its table's size.
        num_workers: DataLoader worker processes per rank that assemble batches.
        shuffle: reshuffle the training data every epoch: rows for raw TSV (held in memory), whole
            global batches for memory-mapped day files (contiguous reads at any scale).
        seed: seed of the training shuffle.
        on_bad_rows: ``error`` stops at the first malformed TSV row (naming file and line); ``skip``
            drops such rows, counts them and reports the count.
        dense_transform: raw TSV dense features become ``log1p`` = log(max(x, 0) + 1) (DLRM's) or
            ``log_plus_3`` = log(x + 3) (TorchRec's former NumPy preprocessing).
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
        num_embeddings_per_feature: int | list[int] = 100_000,
        num_workers: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        on_bad_rows: OnBadRows = "error",
        dense_transform: DenseTransform = "log1p",
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"data.batch_size = {batch_size} must be at least 1")
        if num_workers < 0:
            raise ValueError(f"data.num_workers = {num_workers} must be >= 0")
        self.options = ReadOptions(
            table_sizes=expand_table_sizes(num_embeddings_per_feature, "data.num_embeddings_per_feature"),
            on_bad_rows=on_bad_rows,
            dense_transform=dense_transform,
        )
        self.specs = {name: spec for name, spec in (("train", train), ("val", val), ("test", test), ("predict", predict)) if spec is not None}
        self.split, self.root, self.format = split, root, format
        self._check_inputs_exist()
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.shuffle = shuffle
        self.seed = seed
        self.datasets: dict[str, CriteoBatches] = {}
        self.num_bad_rows_skipped = 0

    def _check_inputs_exist(self) -> None:
        # In the launching process, before any worker starts: a missing file or folder stops here.
        if self.split is not None:
            if self.root is None:
                raise ValueError(f"data.split = {self.split} needs data.root, the folder or file holding the data")
            if any(name in self.specs for name in ("train", "val", "test")):
                raise ValueError("data.split replaces data.train/val/test: set one or the other")
            if not Path(self.root).expanduser().exists():
                raise FileNotFoundError(f"data.root: {self.root} does not exist")
        for name, spec in self.specs.items():
            first = Path(spec if isinstance(spec, str) else spec[0]).expanduser()
            kind = detect_format(first) if self.format == "auto" else self.format
            try:
                if kind == "tsv":
                    expand_paths(spec)
                elif not first.is_dir():
                    raise FileNotFoundError(f"{first}: data directory does not exist")
            except FileNotFoundError as error:
                raise FileNotFoundError(f"data.{name}: {error}") from None

    def setup(self, stage: str) -> None:
        rank, world_size = (self.trainer.global_rank, self.trainer.world_size) if self.trainer else (0, 1)
        sources = self._open_sources(stage)
        for split, source in sources.items():
            self._report_bad_rows(split, source)
            self.datasets[split] = self._rank_batches(split, source, rank, world_size)

    def _open_sources(self, stage: str) -> dict[str, RowSource]:
        wanted = _SPLITS_BY_STAGE[stage]
        if self.split is not None and stage != "predict":
            assert self.root is not None
            return {k: v for k, v in named_split(self.split, self.root, self.format, self.options).items() if k in wanted}
        sources = {}
        for split in wanted:
            if split not in self.specs:
                if split == "val":
                    continue  # fitting without validation is allowed
                raise ValueError(f"data.{split} is not set; `{stage}` needs it")
            labelled = None if split == "predict" else True
            sources[split] = open_split(self.specs[split], self.format, self.options, f"data.{split}", labelled=labelled)
        return sources

    def _report_bad_rows(self, split: str, source: RowSource) -> None:
        skipped = getattr(source, "num_bad_rows", 0)
        if skipped:
            first = getattr(source, "first_bad_row", None)
            rank_zero_warn(f"data.{split}: skipped {skipped} malformed rows (data.on_bad_rows = skip); first: {first}")
            if split == "train":
                self.num_bad_rows_skipped = skipped

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
