"""Raw TSV (plain or gzip) as chunks of parsed rows with raw ids, streamed by the TSV reader."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from app.criteo import NUM_SPARSE
from app.data import tsv
from app.data.tsv import CriteoArrays

# Modulo 2**32 keeps the 32-bit hashed ids as they are: the raw ids.
RAW_IDS = [2**32] * NUM_SPARSE


def iter_chunks(
    path: Path, dense_transform: str, on_bad_rows: str, block_bytes: int, num_threads: int = 1
) -> Iterator[tuple[CriteoArrays, int]]:
    """``(rows with raw ids, number of bad rows skipped)`` per chunk of about ``block_bytes`` of a raw
    TSV file (plain or gzip), streamed by ``app.data.tsv.iter_tsv_chunks``.

    The reader parses blocks of ``tsv.CHUNK_BYTES`` (its cache-friendly size); consecutive blocks
    are joined here into larger chunks, so that the per-chunk work (np.unique, three writes, a
    progress message) is not paid per small block.
    """
    blocks = tsv.iter_tsv_chunks(
        path, RAW_IDS, None, block_bytes=tsv.CHUNK_BYTES, on_bad_rows=on_bad_rows, dense_transform=dense_transform,
        num_threads=num_threads,
    )
    blocks_per_chunk = max(1, block_bytes // tsv.CHUNK_BYTES)
    group: list[CriteoArrays] = []
    skipped = 0
    for arrays, skipped_here in blocks:
        group.append(arrays)
        skipped += skipped_here
        if len(group) == blocks_per_chunk:
            yield CriteoArrays.concat(group), skipped
            group, skipped = [], 0
    if group:
        yield CriteoArrays.concat(group), skipped
