"""Data-path benchmark: ratios measured side by side in one run (`make bench-data`).

1. Raw TSV -> training batches: this project's reader + batch builder, against the approach of the
   ROCm DLRM blog, ``pandas.read_csv`` plus per-column label encoding (``pandas.factorize``, the
   vectorised equivalent of scikit-learn's LabelEncoder), on the same file. Goal: >= 3x.
2. NumPy path: batch assembly from memory-mapped day files, against the rate at which one training
   process of the demo model consumes batches. Goal: >= 10x.
3. Preprocessing (raw TSV -> NumPy) rows/s on one worker, and the time that extrapolates to for
   Criteo Terabyte (4.4 billion rows) on a 64-core host.

Usage: python data/bench_data.py [--rows 500000] [--batch-size 4096]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

TERABYTE_ROWS = 4_373_472_329  # days 0-23
HOST_CORES = 64


def best_of(repeats: int, fn) -> float:
    """Fastest wall time of ``repeats`` calls, in seconds: the least disturbed by other load."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def ours_tsv_to_batches(path: Path, batch_size: int, table_sizes: list[int]) -> int:
    from app.data.dataset import CriteoBatches
    from app.data.tsv import read_tsv

    batches = CriteoBatches(read_tsv(path, table_sizes), batch_size, 0, 1, shuffle=False, seed=0, drop_remainder=False)
    return sum(len(batches[(0, i)].labels) for i in range(len(batches)))


def pandas_tsv_to_arrays(path: Path, table_sizes: list[int]) -> int:
    import pandas as pd

    names = ["label"] + [f"I{i}" for i in range(1, 14)] + [f"C{i}" for i in range(1, 27)]
    frame = pd.read_csv(path, sep="\t", header=None, names=names)
    dense = np.log1p(frame[names[1:14]].fillna(0).clip(lower=0).to_numpy(np.float32))
    sparse = np.stack(
        [pd.factorize(frame[c].fillna("missing"))[0] % size for c, size in zip(names[14:], table_sizes)], axis=1
    )
    labels = frame["label"].to_numpy(np.float32)
    assert dense.shape[0] == sparse.shape[0] == labels.shape[0]
    return len(labels)


def numpy_batches_per_second(folder: Path, batch_size: int, table_sizes: list[int]) -> float:
    from app.data.dataset import CriteoBatches
    from app.data.numpy_days import NumpyDaysSource

    source = NumpyDaysSource.from_directory(folder, None, table_sizes)
    batches = CriteoBatches(source, batch_size, 0, 1, shuffle=True, seed=0, drop_remainder=True)
    seconds = best_of(3, lambda: [batches[(1, i)] for i in range(len(batches))])
    return len(batches) / seconds


def training_batches_per_second(batch_size: int, table_sizes: list[int], num_steps: int = 30) -> float:
    """Steps/s of one process training the demo model (configs/demo.yaml) under the real strategy."""
    import torch
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv

    from app.data.batches import make_batch
    from app.data.source import RowBlock
    from app.module import DLRMModule
    from app.optimizers import StepOnceCombinedOptimizer
    from app.sharding import default_sharders, plan_sharding

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("BENCH_PORT", "29533"), LOCAL_WORLD_SIZE="1")
    dist.init_process_group("gloo", rank=0, world_size=1)
    module = DLRMModule(
        embedding_dim=16, num_embeddings_per_feature=table_sizes, dense_arch_layer_sizes=[64, 16],
        over_arch_layer_sizes=[64, 32, 1],
    )  # fmt: skip
    cpu, sharders = torch.device("cpu"), default_sharders()
    plan = plan_sharding(
        module, world_size=1, local_world_size=1, device=cpu, sharders=sharders, constraints={},
        hbm_cap_bytes=None, ddr_cap_bytes=None, batch_size_per_rank=batch_size, process_group=dist.group.WORLD,
    )  # fmt: skip
    model = DistributedModelParallel(
        module, env=ShardingEnv.from_process_group(dist.group.WORLD), device=cpu, plan=plan, sharders=sharders
    )
    optimizer = StepOnceCombinedOptimizer([("sparse", model.fused_optimizer), ("dense", module.configure_optimizers())])
    rng = np.random.default_rng(0)
    block = RowBlock(
        rng.random((batch_size, 13), dtype=np.float32),
        rng.integers(0, min(table_sizes), (batch_size, 26)),
        rng.integers(0, 2, batch_size).astype(np.float32),
    )
    batch = make_batch(block, np.arange(batch_size))

    def step() -> None:
        optimizer.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(batch), batch.labels)
        loss.backward()
        optimizer.step()

    for _ in range(3):
        step()
    seconds = best_of(1, lambda: [step() for _ in range(num_steps)])
    dist.destroy_process_group()
    return num_steps / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=500_000, help="rows in the generated benchmark file")
    parser.add_argument("--batch-size", type=int, default=4096, help="rows per batch")
    args = parser.parse_args()

    from app.data.synthetic import write_synthetic_criteo
    from app.preprocess import main as preprocess

    table_sizes = [10_000] * 26
    with tempfile.TemporaryDirectory() as tmp:
        tsv = Path(tmp) / "bench.tsv"
        write_synthetic_criteo(tsv, num_rows=args.rows, seed=7)
        size_mb = tsv.stat().st_size / 2**20
        print(f"benchmark file: {args.rows:,} rows, {size_mb:.0f} MiB (synthetic Criteo, 40 fields)\n")

        ours_s = best_of(3, lambda: ours_tsv_to_batches(tsv, args.batch_size, table_sizes))
        pandas_s = best_of(3, lambda: pandas_tsv_to_arrays(tsv, table_sizes))
        print("1. raw TSV -> training data")
        print(f"   this project (read_tsv + batches)      {args.rows / ours_s:>12,.0f} rows/s")
        print(f"   pandas.read_csv + label encoding       {args.rows / pandas_s:>12,.0f} rows/s")
        print(f"   ratio                                  {pandas_s / ours_s:>12.1f}x   (goal >= 3x)\n")

        out = Path(tmp) / "npy"
        start = time.perf_counter()
        preprocess(["--input", str(tsv), "--output", str(out), "--workers", "1", "--progress", "false"])
        preprocess_s = time.perf_counter() - start
        per_core = args.rows / preprocess_s
        assembly = numpy_batches_per_second(out, args.batch_size, table_sizes)
        training = training_batches_per_second(args.batch_size, table_sizes)
        print("2. NumPy day files -> batches, against training")
        print(f"   batch assembly (memory-mapped)         {assembly * args.batch_size:>12,.0f} rows/s")
        print(f"   training, demo model, 1 process        {training * args.batch_size:>12,.0f} rows/s")
        print(f"   ratio                                  {assembly / training:>12.1f}x   (goal >= 10x)\n")

        hours = TERABYTE_ROWS / (per_core * HOST_CORES) / 3600
        input_gb_per_s = per_core * HOST_CORES * (tsv.stat().st_size / args.rows) / 1e9
        print("3. preprocessing raw TSV -> NumPy")
        print(f"   one worker                             {per_core:>12,.0f} rows/s")
        print(f"   Criteo Terabyte ({TERABYTE_ROWS / 1e9:.1f}e9 rows), {HOST_CORES} cores   {hours:>9.2f} hours "
              f"(extrapolated: linear in cores, and only if storage delivers {input_gb_per_s:.1f} GB/s of raw TSV)")


if __name__ == "__main__":
    main()
