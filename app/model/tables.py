"""Embedding table sizes: one table per Criteo categorical feature."""

from __future__ import annotations

from collections.abc import Sequence

from torchrec.datasets.criteo import DEFAULT_CAT_NAMES

NUM_SPARSE_FEATURES = len(DEFAULT_CAT_NAMES)


def expand_table_sizes(
    num_embeddings_per_feature: int | Sequence[int], setting: str, require_all: bool = True
) -> list[int]:
    """Table sizes from one size for all 26 features or a list of sizes; ``setting`` names the flag in errors.

    With ``require_all=False`` a list may hold fewer than 26 sizes: the model then has tables for
    the first features only (C1..Cn), as in benchmarks with other table counts (``app.bench``).
    """
    if isinstance(num_embeddings_per_feature, int):
        sizes = [num_embeddings_per_feature] * NUM_SPARSE_FEATURES
    else:
        sizes = list(num_embeddings_per_feature)
    if len(sizes) != NUM_SPARSE_FEATURES and (require_all or not 1 <= len(sizes) <= NUM_SPARSE_FEATURES):
        wanted = f"{NUM_SPARSE_FEATURES}" if require_all else f"1 to {NUM_SPARSE_FEATURES}"
        raise ValueError(
            f"{setting} has {len(sizes)} sizes; give {wanted} (one per categorical feature C1..C26) "
            "or a single size for all"
        )
    for position, size in enumerate(sizes):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"{setting}[{position}] = {size!r} must be a positive integer")
    return sizes
