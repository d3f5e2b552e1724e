"""Data-path benchmark: figures measured side by side in one run (`make bench-data`).

1. Raw TSV -> NumPy day files (the cache conversion ``fit`` does, ``app.data.preprocess`` on every core)
   against the approach of the ROCm DLRM blog, ``pandas.read_csv`` plus per-column label encoding
   (``pandas.factorize``, the vectorised equivalent of scikit-learn's LabelEncoder), on the same
   file. Goal: >= 10x. Beside it, the same rows as Parquet with string ids (``python -m app.data.to_parquet``)
   -> NumPy day files, the cache conversion of ``data.format: parquet``. Goal: at least the TSV's rate.
2. Cached NumPy days -> batches (memory-mapped) against the rate at which one training process of
   the demo model consumes batches. Goal: >= 10x.
3. ``python -m app fit --config configs/kaggle_dlrm.yaml --data.split kaggle --data.root train.txt``
   (CPU overrides, a fixed number of steps) on a generated train.txt: the first fit (conversion
   included) against a second fit reusing the cache.
4. Host memory of that training process (the second fit: no conversion) on generated train.txt of
   growing size (the 10M-row file is the 1M-row file ten times): peak resident memory (VmHWM) and
   private memory (RssAnon). Goal: within 10 % from 1M to 10M rows.

Usage: python data/bench_data.py [--rows 1000000] [--memory-rows 1000000,10000000] [--batch-size 4096]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere


def best_of(repeats: int, fn) -> float:
    """Fastest wall time of ``repeats`` calls, in seconds: the least disturbed by other load."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def ours_tsv_to_days(path: Path, out: Path) -> None:
    """The conversion the data module's cache runs: app.data.preprocess, every core of this machine."""
    from app.data.preprocess import main as preprocess

    shutil.rmtree(out, ignore_errors=True)
    assert preprocess(["--input", str(path), "--output", str(out), "--progress", "false"]) == 0


def ours_parquet_to_days(path: Path, out: Path) -> None:
    """The cache conversion of data.format: parquet (the default schema: Criteo's columns, hex string ids)."""
    from app.data.parquet.schema import ParquetSchema
    from app.data.preprocess.config import Config
    from app.data.preprocess.runner import run

    shutil.rmtree(out, ignore_errors=True)
    run(Config(inputs=[str(path)], output=out, workers=cores(), progress=False, parquet_schema=ParquetSchema().as_dict()))


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
    from app.train.module import DLRMModule
    from app.train.optimizers import StepOnceCombinedOptimizer
    from app.distributed.sharding import default_sharders, plan_sharding

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


def fit_kaggle(train_txt: Path, run_dir: Path, steps: int, batch_size: int) -> dict[str, float]:
    """``python -m app fit`` on the Kaggle config (CPU overrides, small tables, ``steps`` steps);
    wall seconds and the training process's peak (VmHWM) and private (max RssAnon) memory, MiB."""
    command = [
        sys.executable, "-m", "app", "fit", "--config", "configs/kaggle_dlrm.yaml",
        "--data.split", "kaggle", "--data.root", str(train_txt), "--data.cache_dir", str(run_dir / "cache"),
        "--data.num_embeddings_per_feature", "100000", "--data.batch_size", str(batch_size), "--data.num_workers", "0",
        "--model.embedding_dim", "16", "--model.dense_arch_layer_sizes", "[64, 16]", "--model.over_arch_layer_sizes", "[64, 32, 1]",
        "--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.precision", "32-true",
        "--trainer.max_steps", str(steps), "--trainer.limit_val_batches", "0", "--trainer.logger", "false",
        "--trainer.enable_checkpointing", "false", "--trainer.enable_progress_bar", "false",
        "--trainer.default_root_dir", str(run_dir),
    ]  # fmt: skip
    repo = Path(__file__).resolve().parents[1]
    start = time.perf_counter()
    # Lightning picks a free port itself; the training-rate measurement above set one in this process.
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")}
    log_path = run_dir / "fit.log"
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:  # a file, not a pipe: a pipe nobody reads would stall the child
        child = subprocess.Popen(command, cwd=repo, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        peak_kib = anon_kib = 0
        while child.poll() is None:
            status = _proc_status(child.pid)
            peak_kib = max(peak_kib, status.get("VmHWM", 0))
            anon_kib = max(anon_kib, status.get("RssAnon", 0))
            time.sleep(0.05)
    if child.returncode != 0:
        raise RuntimeError(f"fit failed ({child.returncode}):\n{log_path.read_text()[-3000:]}")
    return {"seconds": time.perf_counter() - start, "peak_mib": peak_kib / 1024, "private_mib": anon_kib / 1024}


def _proc_status(pid: int) -> dict[str, int]:
    """The kB figures of /proc/PID/status (empty once the process is gone)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    return {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in lines) if v.strip().endswith("kB")}


def repeat_file(source: Path, times: int, target: Path) -> None:
    """``times`` copies of ``source`` one after the other (a bigger train.txt without generating it)."""
    with open(target, "wb") as out:
        for _ in range(times):
            with open(source, "rb") as part:
                shutil.copyfileobj(part, out, 16 << 20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows in the generated benchmark file")
    parser.add_argument("--memory-rows", default="1000000,10000000",
                        help="sizes of the train.txt files the memory figure compares (multiples of --rows)")
    parser.add_argument("--fit-steps", type=int, default=20, help="training steps of each fit")
    parser.add_argument("--batch-size", type=int, default=4096, help="rows per batch")
    args = parser.parse_args()

    from app.data.synthetic import write_synthetic_criteo

    table_sizes = [10_000] * 26
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        tsv = tmp / "train.txt"
        write_synthetic_criteo(tsv, num_rows=args.rows, seed=7)
        size_mb = tsv.stat().st_size / 2**20
        print(f"benchmark file: {args.rows:,} rows, {size_mb:.0f} MiB (synthetic Criteo, 40 fields), {cores()} cores\n")

        ours_s = best_of(2, lambda: ours_tsv_to_days(tsv, tmp / "npy"))
        pandas_s = best_of(2, lambda: pandas_tsv_to_arrays(tsv, table_sizes))
        print("1. raw TSV -> NumPy day files")
        print(f"   this project (app.data.preprocess, {cores()} cores)   {args.rows / ours_s:>12,.0f} rows/s")
        print(f"   pandas.read_csv + label encoding       {args.rows / pandas_s:>12,.0f} rows/s")
        print(f"   ratio                                  {pandas_s / ours_s:>12.1f}x   (goal >= 10x)")
        from app.data.to_parquet import to_parquet

        to_parquet(str(tsv), str(tmp / "parquet"))
        parquet_s = best_of(2, lambda: ours_parquet_to_days(tmp / "parquet" / "train.parquet", tmp / "npy_parquet"))
        print(f"   the same rows as Parquet, string ids   {args.rows / parquet_s:>12,.0f} rows/s")
        print(f"   Parquet over TSV                       {ours_s / parquet_s:>12.2f}x   (goal >= 1)\n")

        assembly = numpy_batches_per_second(tmp / "npy", args.batch_size, table_sizes)
        training = training_batches_per_second(args.batch_size, table_sizes)
        print("2. cached NumPy day files -> batches, against training")
        print(f"   batch assembly (memory-mapped)         {assembly * args.batch_size:>12,.0f} rows/s")
        print(f"   training, demo model, 1 process        {training * args.batch_size:>12,.0f} rows/s")
        print(f"   ratio                                  {assembly / training:>12.1f}x   (goal >= 10x)\n")

        print("3. python -m app fit --config configs/kaggle_dlrm.yaml --data.split kaggle --data.root train.txt")
        print(f"   (CPU, 1 process, {args.fit_steps} steps of {args.batch_size} rows, tables of 100k x 16)")
        first = fit_kaggle(tsv, tmp / "run", args.fit_steps, args.batch_size)
        second = fit_kaggle(tsv, tmp / "run", args.fit_steps, args.batch_size)
        print(f"   first fit, raw TSV converted           {first['seconds']:>12.1f} s")
        print(f"   second fit, cache reused               {second['seconds']:>12.1f} s\n")

        print("4. host memory of that training process (second fit: cache reused)")
        figures = {}
        for rows in [int(r) for r in args.memory_rows.split(",")]:
            if rows == args.rows:
                figures[rows] = second
                continue
            bigger = tmp / f"train_{rows}.txt"
            repeat_file(tsv, rows // args.rows, bigger)
            fit_kaggle(bigger, tmp / f"run_{rows}", args.fit_steps, args.batch_size)  # converts
            figures[rows] = fit_kaggle(bigger, tmp / f"run_{rows}", args.fit_steps, args.batch_size)
            bigger.unlink()
        for rows, figure in figures.items():
            print(f"   {rows:>12,} rows: peak resident {figure['peak_mib']:>8,.0f} MiB, private {figure['private_mib']:>8,.0f} MiB")
        smallest, largest = figures[min(figures)], figures[max(figures)]
        growth = largest["peak_mib"] / smallest["peak_mib"] - 1
        print(f"   growth of the peak from the smallest to the largest: {growth:+.1%}   (goal within 10 %)")


def cores() -> int:
    from app.data.preprocess import default_workers

    return default_workers()


if __name__ == "__main__":
    main()
