"""``data.prepare_data_per_node``: which ranks convert the raw-TSV cache (docs/data.md, "Who converts").

``true`` (the default, for a node-local ``cache_dir``): local rank 0 of every node; ``false`` (for a
``cache_dir`` on storage every node sees): global rank 0 only, the other nodes reading its cache. Checked
through ``CriteoDataModule.setup`` as a Trainer calls it, on one machine: the Trainer of node 1's first
rank (local rank 0, global rank 1) stands in as an object with those ranks, since one machine cannot
start a second node's rank for real without a second rendezvous (tests/distributed/test_cluster.py does that).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from app.data.datamodule import CriteoDataModule


def _rank_of_a_two_node_run(global_rank: int, local_rank: int) -> SimpleNamespace:
    """What setup reads of a Trainer: the ranks, and the strategy's barrier (one process here: passes)."""
    strategy = SimpleNamespace(barrier=lambda name=None: None, barrier_timeout_s=60.0)
    return SimpleNamespace(global_rank=global_rank, local_rank=local_rank, world_size=2, strategy=strategy,
                           ckpt_path=None, state=SimpleNamespace(fn=None))  # fmt: skip


def _set_up(train: Path, cache_dir: Path, per_node: bool, global_rank: int, local_rank: int) -> CriteoDataModule:
    data = CriteoDataModule(train=str(train), cache_dir=str(cache_dir), prepare_data_per_node=per_node,
                            num_embeddings_per_feature=500, frequency_threshold=0, batch_size=64)  # fmt: skip
    data.trainer = _rank_of_a_two_node_run(global_rank, local_rank)
    data.setup("fit")
    return data


def test_with_prepare_data_per_node_false_only_global_rank_0_converts(sample, tmp_path, capsys):
    shared = tmp_path / "shared_cache"
    # Node 1's first rank leaves the conversion to global rank 0: alone (before it), it finds no cache.
    with pytest.raises(ValueError, match=r"shared_cache/train-[0-9a-f]+ is not complete"):
        _set_up(sample["train"], shared, per_node=False, global_rank=1, local_rank=0)
    assert "preprocessed" not in capsys.readouterr().out
    node0 = _set_up(sample["train"], shared, per_node=False, global_rank=0, local_rank=0)
    assert "preprocessed 1,536 rows" in capsys.readouterr().out  # global rank 0 converted
    node1 = _set_up(sample["train"], shared, per_node=False, global_rank=1, local_rank=0)
    assert "preprocessed" not in capsys.readouterr().out  # node 1's first rank read rank 0's cache
    # One cache for both; each node's rank takes its half of the same 12 global batches.
    assert len([p for p in shared.iterdir() if p.is_dir()]) == 1
    assert len(node1.datasets["train"]) == len(node0.datasets["train"]) == 12
    first = [node.datasets["train"][0, 0].row_ids.tolist() for node in (node0, node1)]
    start = first[0][0]  # the epoch's first global batch of 128 rows (global batches are shuffled)
    assert first == [list(range(start, start + 64)), list(range(start + 64, start + 128))]

    # true: node 1's first rank converts into its own (node-local) cache folder as well.
    _set_up(sample["train"], tmp_path / "node1_local_cache", per_node=True, global_rank=1, local_rank=0)
    assert "preprocessed 1,536 rows" in capsys.readouterr().out
