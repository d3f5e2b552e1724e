"""What to preprocess: the options of a run (:class:`Config`, checked by :func:`check_config`),
one input file's task (:class:`DayTask`) and what a worker reports back (:class:`DayResult`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Bytes of text parsed per chunk: the chunk's parsed arrays and temporaries are a few times this.
DEFAULT_BLOCK_MIB = 8
DENSE_TRANSFORMS = ("log1p", "log_plus_3")
# Bump when the output layout changes, so that a re-run does not mix old and new days.
FORMAT_VERSION = 2  # 2: ids stored as int32 (raw 32-bit hashes and contiguous ids both fit)


@dataclass(frozen=True)
class Config:
    """What to preprocess and how (the command-line options)."""

    inputs: list[str]
    output: Path
    workers: int = 1
    frequency_threshold: int = 0
    vocabulary: Path | None = None
    dense_transform: str = "log1p"
    on_bad_rows: str = "error"
    block_mib: int = DEFAULT_BLOCK_MIB
    progress: bool = True
    parquet_schema: dict[str, Any] | None = None  # Parquet inputs: ParquetSchema.as_dict(); None: raw TSV


@dataclass(frozen=True)
class DayTask:
    """One input file and where its day goes; sent to a worker process."""

    day: int
    input: Path
    output: Path
    dense_transform: str
    on_bad_rows: str
    block_bytes: int
    vocabulary_dir: Path | None  # where vocab_feature_j.npy are, or None for raw ids
    signature: dict[str, Any] = field(default_factory=dict)  # what makes two runs' days alike
    num_threads: int = 1  # parse threads of the worker (more when there are fewer files than cores)
    parquet_schema: dict[str, Any] | None = None  # Parquet input: ParquetSchema.as_dict(); None: raw TSV

    def path(self, part: str) -> Path:
        """``day_N_<part>`` in the output folder, e.g. ``part="dense.npy"``."""
        return self.output / f"day_{self.day}_{part}"


@dataclass
class DayResult:
    """What a worker reports about a day it converted."""

    day: int
    rows: int
    busy_seconds: float


def check_config(config: Config) -> None:
    if config.workers < 1:
        raise ValueError(f"--workers {config.workers}: must be at least 1")
    if config.frequency_threshold < 0:
        raise ValueError(f"--frequency_threshold {config.frequency_threshold}: must be >= 0 (0 = raw ids)")
    if config.vocabulary is not None and config.frequency_threshold:
        raise ValueError(
            "--vocabulary and --frequency_threshold exclude each other: the vocabulary already applies its threshold"
        )
    if config.dense_transform not in DENSE_TRANSFORMS:
        raise ValueError(f"--dense_transform {config.dense_transform}: expected one of {', '.join(DENSE_TRANSFORMS)}")
    if config.on_bad_rows not in ("error", "skip"):
        raise ValueError(f"--on_bad_rows {config.on_bad_rows}: expected error or skip")
    if config.block_mib < 1:
        raise ValueError(f"--block_mib {config.block_mib}: must be at least 1")
