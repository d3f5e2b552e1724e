"""The Criteo click logs' features, one definition for every layer: 13 integer (dense) features
I1..I13, 26 categorical (sparse) features C1..C26 with one embedding table each, and how a table-size
setting becomes one size per table.

A leaf (docs/architecture.md): it imports nothing from ``app``, so that the data and the model,
which may not import each other, read the same counts.
"""

from __future__ import annotations

from collections.abc import Sequence

NUM_DENSE = 13  # I1..I13
NUM_SPARSE = 26  # C1..C26
DENSE_NAMES = tuple(f"I{i}" for i in range(1, NUM_DENSE + 1))
SPARSE_NAMES = tuple(f"C{i}" for i in range(1, NUM_SPARSE + 1))


def expand_table_sizes(
    num_embeddings_per_feature: int | Sequence[int], setting: str, require_all: bool = True
) -> list[int]:
    """Table sizes from one size for all 26 features or a list of sizes; ``setting`` names the flag in errors.

    With ``require_all=False`` a list may hold fewer than 26 sizes: the model then has tables for
    the first features only (C1..Cn), as in benchmarks with other table counts (``app.bench``).
    """
    if isinstance(num_embeddings_per_feature, int):
        sizes = [num_embeddings_per_feature] * NUM_SPARSE
    else:
        sizes = list(num_embeddings_per_feature)
    if len(sizes) != NUM_SPARSE and (require_all or not 1 <= len(sizes) <= NUM_SPARSE):
        wanted = f"{NUM_SPARSE}" if require_all else f"1 to {NUM_SPARSE}"
        raise ValueError(
            f"{setting} has {len(sizes)} sizes; give {wanted} (one per categorical feature C1..C26) "
            "or a single size for all"
        )
    for position, size in enumerate(sizes):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"{setting}[{position}] = {size!r} must be a positive integer")
    return sizes
