"""Embedding table sizes: one table per Criteo categorical feature."""

from __future__ import annotations

from collections.abc import Sequence

from torchrec.datasets.criteo import DEFAULT_CAT_NAMES

NUM_SPARSE_FEATURES = len(DEFAULT_CAT_NAMES)


def expand_table_sizes(num_embeddings_per_feature: int | Sequence[int], setting: str) -> list[int]:
    """26 table sizes from either 26 sizes or one size for all; ``setting`` names the flag in errors."""
    if isinstance(num_embeddings_per_feature, int):
        sizes = [num_embeddings_per_feature] * NUM_SPARSE_FEATURES
    else:
        sizes = list(num_embeddings_per_feature)
    if len(sizes) != NUM_SPARSE_FEATURES:
        raise ValueError(
            f"{setting} has {len(sizes)} sizes; give {NUM_SPARSE_FEATURES} (one per categorical feature C1..C26) "
            "or a single size for all"
        )
    for position, size in enumerate(sizes):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"{setting}[{position}] = {size!r} must be a positive integer")
    return sizes
