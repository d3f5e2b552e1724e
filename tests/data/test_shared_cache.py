"""The raw-TSV cache on storage shared by several nodes: converted once
whatever the number of converters, a converter that finds another node converting waits for it or
stops with one line naming the folder and the holder, files written under names of their own, and
the ranks that wait for the conversion at start-up wait at a bounded barrier.

Nodes are processes with a host name of their own (``socket.gethostname`` replaced in the child,
which is what names a holder's host); the test lets each one go at the exact point it needs (a line
on stdin), so nothing depends on timing."""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist

from app.data.cache import CacheRequest
from app.data.lock_file import read_holder
from app.data.preprocess.files import partial_path
from app.data.synthetic import write_synthetic_criteo
from app.data.tsv import read_tsv
from tests.child_process import LIMIT_S, finish, read_until, tell

ROOT = Path(__file__).resolve().parents[2]

# A converter "node": converts the cache of argv[1] into argv[2] as host argv[3], waiting up to argv[4]
# s for another converter; with argv[5] == "hold", it says HOLDING once it holds the lock and waits for
# a line on stdin before converting. Every conversion appends its host to <cache>/conversions.
NODE = """
import socket, sys
from pathlib import Path
socket.gethostname = lambda: sys.argv[3]
import app.data.cache as cache
convert = cache._convert
def counted(request, folder):
    with open(Path(sys.argv[2]) / "conversions", "a") as log:
        log.write(sys.argv[3] + "\\n")
    if sys.argv[5] == "hold":
        print("HOLDING", flush=True)
        sys.stdin.readline()
    convert(request, folder)
cache._convert = counted
request = cache.CacheRequest((Path(sys.argv[1]),), "log1p", "error", Path(sys.argv[2]), workers=1, wait_s=float(sys.argv[4]))
try:
    print("FOLDER", cache.cached_days(request), flush=True)
except ValueError as error:
    print(f"error: {error}", file=sys.stderr, flush=True)
    sys.exit(2)
"""


def node(raw: Path, cache_dir: Path, host: str, wait_s: float, hold: bool) -> subprocess.Popen:
    command = [sys.executable, "-c", NODE, str(raw), str(cache_dir), host, str(wait_s), "hold" if hold else "go"]
    return subprocess.Popen(command, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture
def raw(tmp_path) -> Path:
    path = tmp_path / "day_0.tsv"
    write_synthetic_criteo(path, num_rows=3_000, seed=31)
    return path


def test_two_nodes_converting_one_shared_cache_convert_it_once(raw, tmp_path):
    cache_dir = tmp_path / "shared_cache"
    cache_dir.mkdir()
    folder = CacheRequest((raw,), "log1p", "error", cache_dir).folder
    first = node(raw, cache_dir, "node-a", wait_s=LIMIT_S, hold=True)
    read_until(first.stdout, "HOLDING")  # node-a holds the lock and has not converted yet
    assert read_holder(Path(f"{folder}.lock")).host == "node-a"
    second = node(raw, cache_dir, "node-b", wait_s=LIMIT_S, hold=False)
    waiting = read_until(second.stderr, "waiting up to")
    assert f"data cache {folder}: waiting up to {float(LIMIT_S):g} s for pid {first.pid} on node-a since" in waiting
    tell(first)
    results = [finish(first), finish(second)]
    assert [code for code, _, _ in results] == [0, 0], results
    assert [out.split()[-1] for _, out, _ in results] == [str(folder)] * 2
    assert (cache_dir / "conversions").read_text() == "node-a\n"  # node-b converted nothing
    assert not Path(f"{folder}.lock").exists()
    assert not [p.name for p in folder.iterdir() if ".partial" in p.name]
    want = read_tsv(raw, [2**32] * 26)
    np.testing.assert_array_equal(np.load(folder / "day_0_sparse.npy").view(np.uint32), want.sparse)
    np.testing.assert_array_equal(np.load(folder / "day_0_dense.npy"), want.dense)


def test_a_node_that_will_not_wait_longer_is_told_the_folder_and_the_holder(raw, tmp_path):
    cache_dir = tmp_path / "shared_cache"
    cache_dir.mkdir()
    folder = CacheRequest((raw,), "log1p", "error", cache_dir).folder
    first = node(raw, cache_dir, "node-a", wait_s=LIMIT_S, hold=True)
    try:
        read_until(first.stdout, "HOLDING")
        code, _, err = finish(node(raw, cache_dir, "node-b", wait_s=0, hold=False))
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert code == 2 and len(errors) == 1, err
        assert errors[0].startswith(f"error: data cache {folder} is being converted by pid {first.pid} on node-a since")
        assert errors[0].endswith(
            f"; waited 0 s: let it finish, or if that process is gone delete {folder}.lock; or set data.cache_dir "
            "to convert elsewhere"
        )
        assert "node-a" in Path(f"{folder}.lock").read_text()  # the holder's lock and folder untouched
        tell(first)
        assert finish(first)[0] == 0
    finally:
        first.kill()
        first.wait()
    assert (cache_dir / "conversions").read_text() == "node-a\n"


def test_a_converter_gone_on_this_host_is_taken_over_and_its_half_written_files_deleted(raw, tmp_path):
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    folder = CacheRequest((raw,), "log1p", "error", cache_dir).folder
    first = node(raw, cache_dir, "node-a", wait_s=LIMIT_S, hold=True)
    read_until(first.stdout, "HOLDING")
    leftover = Path(f"{folder / 'day_0_dense.npy'}.partial-node-a-{first.pid}")
    leftover.write_bytes(b"half a file")
    first.kill()  # killed holding the lock, e.g. its job was cancelled
    first.wait()
    code, out, err = finish(node(raw, cache_dir, "node-a", wait_s=0, hold=False))  # the same host again
    assert code == 0, err
    assert f"data cache {folder}: took the lock over from pid {first.pid} on node-a since" in err
    assert not leftover.exists()
    assert (cache_dir / "conversions").read_text() == "node-a\nnode-a\n"


def test_two_writers_of_one_file_write_under_names_of_their_own(tmp_path):
    script = "import sys; from pathlib import Path; from app.data.preprocess.files import partial_path; print(partial_path(Path(sys.argv[1])))"
    names = {subprocess.run([sys.executable, "-c", script, str(tmp_path / "x.npy")], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout.strip() for _ in range(2)}  # fmt: skip
    names.add(str(partial_path(tmp_path / "x.npy")))
    assert len(names) == 3 and all(name.startswith(f"{tmp_path / 'x.npy'}.partial-") for name in names)


# ---- the wait at start-up ------------------------------------------------------------------------

# Rank argv[1] of 2 joins the test's store at port argv[2] with a TorchRecStrategy whose barriers wait
# argv[3] s, and sets up a CriteoDataModule under a stand-in for the Trainer. Rank 0 converts (local
# rank 0) and is held just before it, until the test kills it: a converting rank that never comes.
RANK = """
import os, sys
from types import SimpleNamespace
os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
rank, port, barrier_timeout_s, train, cache_dir = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], sys.argv[5]
from app.distributed.rendezvous import join_process_group
from app.distributed.strategy import TorchRecStrategy
from app.data.datamodule import CriteoDataModule
import app.data.datamodule as datamodule
join_process_group("gloo", address="127.0.0.1", port=port, rank=rank, world_size=2, processes_per_node=2,
                   rendezvous_timeout_s=60, timeout_s=60)
strategy = TorchRecStrategy(barrier_timeout_s=barrier_timeout_s)
data = CriteoDataModule(train=train, batch_size=8, cache_dir=cache_dir, cache_workers=1, num_embeddings_per_feature=100)
data.trainer = SimpleNamespace(local_rank=rank, global_rank=rank, world_size=2, strategy=strategy, ckpt_path=None)
if rank == 0:
    def held(*args, **kwargs):
        print("CONVERTING", flush=True)
        sys.stdin.readline()
    datamodule.CriteoDataModule._cached_folder = held
strategy.barrier("pre_setup")  # as Lightning's setup hook does first
try:
    data.setup("fit")
    print("SET UP", flush=True)
except ValueError as error:
    print(f"error: {error}", file=sys.stderr, flush=True)
    os._exit(2)
"""


def test_ranks_waiting_for_the_conversion_stop_at_the_barrier_timeout_naming_it(raw, tmp_path):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=LIMIT_S))
    ranks = [
        subprocess.Popen([sys.executable, "-c", RANK, str(rank), str(store.port), "2", str(raw), str(tmp_path / "cache")],
                         cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank in range(2)
    ]  # fmt: skip
    try:
        read_until(ranks[0].stdout, "CONVERTING")  # rank 0 works and will not come to the barrier
        code, out, err = finish(ranks[1])
    finally:
        for process in ranks:
            process.kill()
            process.wait()
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and "SET UP" not in out and len(errors) == 1, err[-3000:]
    assert errors[0].startswith(
        "error: rank 1: waited trainer.strategy.init_args.barrier_timeout_s = 2 s at the cache_conversion barrier "
        "(the raw-TSV cache being converted, app.data.cache) for a rank that did not come: raise it if that work "
        "takes longer; "
    ), errors[0]
