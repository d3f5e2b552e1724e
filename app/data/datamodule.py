"""The Criteo LightningDataModule: raw TSV splits in, per-rank TorchRec batches out."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader

from app.data.dataset import CriteoBatches
from app.data.loader import ResumableBatchLoader
from app.data.tsv import CriteoArrays, expand_paths, read_tsv_files
from app.model.tables import expand_table_sizes

PathSpec = str | list[str]

_SPLITS_BY_STAGE = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",), "predict": ("predict",)}


class CriteoDataModule(LightningDataModule):
    """Reads raw Criteo TSV files (``label, I1..I13, C1..C26``; no label for ``predict``) for every rank.

    Each step trains on one global batch of ``batch_size * world_size`` rows, split across the ranks;
    evaluation visits every row exactly once. Categorical ids are hashed modulo the table sizes.

    Args:
        train: training rows: a file, a glob, a directory of ``.tsv``/``.txt`` files, or a list of those.
        val: validation rows (same forms as ``train``).
        test: test rows (same forms as ``train``).
        predict: rows to score; may be unlabelled (39 fields, like Kaggle's ``test.txt``).
        batch_size: rows per batch on each process (the global batch is this times the world size).
        num_embeddings_per_feature: rows of each embedding table: 26 sizes, or one size for all; each
            categorical id is taken modulo its table's size.
        num_workers: DataLoader worker processes per rank that assemble batches.
        shuffle: reshuffle the training rows every epoch.
        seed: seed of the training shuffle.
    """

    def __init__(
        self,
        train: PathSpec | None = None,
        val: PathSpec | None = None,
        test: PathSpec | None = None,
        predict: PathSpec | None = None,
        batch_size: int = 4096,
        num_embeddings_per_feature: int | list[int] = 100_000,
        num_workers: int = 0,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"data.batch_size = {batch_size} must be at least 1")
        if num_workers < 0:
            raise ValueError(f"data.num_workers = {num_workers} must be >= 0")
        self.table_sizes = expand_table_sizes(num_embeddings_per_feature, "data.num_embeddings_per_feature")
        # Resolve paths now, in the launching process, so a missing file stops the run before any
        # worker process starts.
        self.paths: dict[str, list[Path]] = {}
        for split, spec in (("train", train), ("val", val), ("test", test), ("predict", predict)):
            if spec is not None:
                self.paths[split] = _resolve(spec, f"data.{split}")
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.shuffle = shuffle
        self.seed = seed
        self.datasets: dict[str, CriteoBatches] = {}

    def setup(self, stage: str) -> None:
        rank, world_size = (self.trainer.global_rank, self.trainer.world_size) if self.trainer else (0, 1)
        for split in _SPLITS_BY_STAGE[stage]:
            if split not in self.paths:
                if split == "val":
                    continue  # fitting without validation is allowed
                raise ValueError(f"data.{split} is not set; `{stage}` needs it")
            arrays = read_tsv_files(self.paths[split], self.table_sizes, labelled=None if split == "predict" else True)
            self.datasets[split] = self._rank_batches(split, arrays, rank, world_size)

    def _rank_batches(self, split: str, arrays: CriteoArrays, rank: int, world_size: int) -> CriteoBatches:
        is_train = split == "train"
        if is_train and len(arrays) < world_size:
            raise ValueError(f"data.train has {len(arrays)} rows, fewer than the {world_size} processes")
        return CriteoBatches(
            arrays,
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
        return self._loader("predict")


def _resolve(spec: str | Sequence[str], setting: str) -> list[Path]:
    try:
        return expand_paths(spec)
    except FileNotFoundError as error:
        raise FileNotFoundError(f"{setting}: {error}") from None
