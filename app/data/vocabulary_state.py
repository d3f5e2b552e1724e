"""``data.frequency_threshold``'s vocabulary as the data module's checkpoint state.

A checkpoint (and an exported model) keeps ``{"frequency_threshold": T, "vocabulary": Vocabulary}``
(app/checkpoint/vocabulary.py writes the arrays). Restored before ``setup`` (the CLI hands a
checkpoint's state over as it builds the run, app/checkpoint/saved_model.py), that vocabulary maps
every split of the run, so scoring or resuming needs neither the training data nor its count.
Restored after ``setup`` (Lightning's own restore, for a Trainer used without the CLI), the splits
are already mapped with the vocabulary counted over ``data.train``: the two must then be the same.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from app.criteo import SPARSE_NAMES
from app.data.preprocess import Vocabulary
from app.data.preprocess.vocabulary import VOCABULARY_FILE

SETTING = "data.frequency_threshold"


class VocabularyState:
    """The vocabulary a run maps ids with: the checkpoint's (restored) or the one counted over data.train."""

    def __init__(self, threshold: int) -> None:
        if threshold < 0:
            raise ValueError(f"{SETTING} = {threshold} must be >= 0 (0 = off)")
        self.threshold = threshold
        self.counted: Vocabulary | None = None  # counted over this run's data.train (or read from its cache)
        self.restored: Vocabulary | None = None  # a checkpoint's
        self.restored_threshold: int | None = None  # None: no checkpoint state restored

    @property
    def vocabulary(self) -> Vocabulary | None:
        """What the ids are mapped with: a restored checkpoint's vocabulary wins over this run's count."""
        return self.restored if self.restored is not None else self.counted

    def in_cache(self, cache_root: Path, write: bool) -> Vocabulary:
        """The vocabulary backed by files, which the mapping workers read: one restored from an exported
        model lives in memory only, so it is written once into ``cache_root`` (by a converting rank:
        ``write``) and read back from there, memory-mapped."""
        vocabulary = self.vocabulary
        assert vocabulary is not None
        if vocabulary.folder is not None:
            return vocabulary
        folder = cache_root / f"vocabulary-{vocabulary.sha256[:12]}"
        if write and not (folder / VOCABULARY_FILE).is_file():
            vocabulary.save(folder)  # vocabulary.json last: its presence marks the folder complete
        self.restored = Vocabulary.load(folder)
        return self.restored

    def state_dict(self) -> dict[str, Any]:
        """The threshold and its vocabulary (nothing without a threshold)."""
        if not self.threshold:
            return {}
        return {"frequency_threshold": self.threshold, "vocabulary": self.vocabulary}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Takes a checkpoint's threshold and vocabulary (a :class:`Vocabulary`, or its plain form from an
        exported model file)."""
        vocabulary = state_dict.get("vocabulary")
        if vocabulary is not None and not isinstance(vocabulary, Vocabulary):
            vocabulary = Vocabulary.from_plain(vocabulary)
        self.restored_threshold = int(state_dict.get("frequency_threshold", 0))
        self.restored = vocabulary

    def check_restored(self, ckpt_path: str, same_vocabulary: bool) -> None:
        """A restored checkpoint's ids must mean what this run's ids mean: the same threshold, and
        (``same_vocabulary``: splits this run mapped with a vocabulary of its own count) the same
        vocabulary. Predict maps with the checkpoint's own, whatever data.train holds now."""
        if self.restored_threshold is None:
            return
        trained = self.restored_threshold
        if trained != self.threshold:
            how = f"its vocabulary maps the ids: set {SETTING} {trained}" if trained else f"raw hashed ids: set {SETTING} 0"
            raise ValueError(f"ckpt_path {ckpt_path} was trained with {SETTING} = {trained}, this run has {self.threshold} ({how})")
        if trained and self.restored is None:
            raise ValueError(f"ckpt_path {ckpt_path}: trained with {SETTING} = {trained} but holds no vocabulary")
        counted, restored = self.counted, self.restored
        if same_vocabulary and trained and counted is not None and restored is not None and restored.sha256 != counted.sha256:
            raise ValueError(
                f"ckpt_path {ckpt_path} was trained with another vocabulary (sha256 {restored.sha256[:12]}) than the one "
                f"{SETTING} = {trained} counts over data.train now ({counted.sha256[:12]}): its ids would mean other "
                "things; use the training data of that checkpoint"
            )

    def map_raw_ids(self, sparse: np.ndarray, table_sizes: list[int]) -> np.ndarray:
        """Maps raw 32-bit ids (N, 26) in place with the vocabulary, then modulo the table sizes;
        returns, per feature, how many ids were outside the vocabulary (mapped to 1)."""
        vocabulary = self.vocabulary
        if vocabulary is None:
            raise ValueError(
                f"{SETTING} = {self.threshold}: predict maps ids with the vocabulary saved in the checkpoint it "
                "scores with; give --ckpt_path (a checkpoint or model file trained with this threshold)"
            )
        warn_about_small_tables(vocabulary, table_sizes)
        outside = np.zeros(sparse.shape[1], dtype=np.int64)
        vocabulary.map(sparse, out=sparse, outside_counts=outside)
        np.remainder(sparse, np.asarray(table_sizes, dtype=np.int64), out=sparse)
        return outside


def warn_about_small_tables(vocabulary: Vocabulary, table_sizes: list[int]) -> None:
    """Warns where a table is smaller than its vocabulary + 2: kept ids then share rows."""
    small = [
        f"{SPARSE_NAMES[j]} ({table_sizes[j]} rows for {needed})"
        for j, needed in enumerate(vocabulary.table_sizes)
        if table_sizes[j] < needed
    ]
    if small:
        rank_zero_warn(
            f"data.num_embeddings_per_feature: tables smaller than their vocabulary + 2: {', '.join(small[:4])}"
            f"{' ...' if len(small) > 4 else ''}; contiguous ids are taken modulo the table size, so kept ids "
            "share rows there (auto gives each its own)"
        )
