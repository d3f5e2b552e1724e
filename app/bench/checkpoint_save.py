"""What the shard checksums cost a checkpoint save (app/checkpoint/checksums.py), measured two ways:

- ``fit``: the checkpoint saves of a real demo fit (configs/demo.yaml on the bundled sample, ``make sample``; 2 CPU
  processes), each timed as a user waits for it: ModelCheckpoint's hook from start to end (the top-k save,
  ``last.ckpt``, the meta file, the rename, the previous checkpoint removed), with the checksums on and off
  at alternate saves (on, off, off, on, ...: a drift in the machine's speed weighs on both alike);
- ``dcp``: ``torch.distributed.checkpoint.save`` alone in one process, DCP's own writer against the
  checksumming one, alternating the same way, on the demo checkpoint's tensors (their names, shapes and
  types, from the fit's checkpoint) and on the bench preset's 26 x 100,000 x 64 float32 tables.

    python -m app.bench.checkpoint_save --work /tmp/checkpoint_save

``--dcp_folder /dev/shm/checkpoint_save`` puts the DCP-alone saves on a tmpfs: the processor's cost alone.

Prints one JSON line per measured case: the medians and ranges (min, max) of both arms in milliseconds,
the cost as the medians' difference and as the median difference of neighbouring saves (one of each arm),
each also as a share of the unchecked median, and the machine's load average. Writes only under ``--work``
(about 2 minutes on 2 cores; ``--skip_fit true`` repeats the DCP-alone cases on the fit's checkpoint). ``--help``
and ``--config`` as every command of the app.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from app.checkpoint.checksums import ChecksummingFileSystemWriter
from app.checkpoint.format import read as read_checkpoint
from app.command import run_command

BENCH_TABLES = (26, 100_000, 64)  # configs/bench's tables: count, rows, dimension
REPOSITORY = Path(__file__).resolve().parents[2]
DEMO_TRAIN_ROWS = REPOSITORY / "data" / "sample" / "train.tsv"  # configs/demo.yaml's data.train (make sample)


class SaveTimer(Callback):
    """Times each ModelCheckpoint hook call that saved, on global rank 0, into ``output`` (JSON lines);
    turns the strategy's checkpoint checksums on or off before each, on, off, off, on, ... (the same on every
    rank: each counts the saves alike)."""

    def __init__(self, output: str) -> None:
        self.output = Path(output)
        self.records: list[dict[str, Any]] = []
        self._saved = 0  # trainer.save_checkpoint calls so far

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        save = trainer.save_checkpoint

        def counted_save(*args: Any, **kwargs: Any) -> None:
            save(*args, **kwargs)
            self._saved += 1

        trainer.save_checkpoint = counted_save  # type: ignore[method-assign]
        for callback in trainer.checkpoint_callbacks:
            for hook in ("on_train_batch_end", "on_validation_end", "on_train_epoch_end"):
                setattr(callback, hook, self._timed(trainer, getattr(callback, hook)))

    def _timed(self, trainer: Trainer, hook: Any) -> Any:
        def timed_hook(*args: Any, **kwargs: Any) -> None:
            checksums = len(self.records) % 4 in (0, 3)
            trainer.strategy.checkpoint_checksums = checksums
            saved, start = self._saved, time.perf_counter()
            hook(*args, **kwargs)
            seconds = time.perf_counter() - start
            if self._saved > saved:
                self.records.append({"checksums": checksums, "saves": self._saved - saved, "hook_s": seconds})

        return timed_hook

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if trainer.is_global_zero:
            self.output.write_text("".join(json.dumps(record) + "\n" for record in self.records))


def summary(case: str, timed: list[tuple[bool, float]]) -> dict[str, Any]:
    """Medians and ranges of both arms, in ms, of saves ``timed`` in order as (checksums, seconds); the cost of
    the checksums as the medians' difference and as the median of the differences between neighbours (the
    saves 2i and 2i + 1, one with and one without: a drift of the machine's speed cancels there)."""
    on_s = [seconds for checksums, seconds in timed if checksums]
    off_s = [seconds for checksums, seconds in timed if not checksums]
    on, off = statistics.median(on_s), statistics.median(off_s)
    pairs = [(a, b) for a, b in zip(timed[::2], timed[1::2]) if a[0] != b[0]]
    paired = statistics.median((a[1] - b[1]) * (1 if a[0] else -1) for a, b in pairs)
    return {
        "case": case, "repeats": [len(on_s), len(off_s)],
        "checksums_ms": {"median": round(on * 1e3, 2), "range": [round(min(on_s) * 1e3, 2), round(max(on_s) * 1e3, 2)]},
        "plain_ms": {"median": round(off * 1e3, 2), "range": [round(min(off_s) * 1e3, 2), round(max(off_s) * 1e3, 2)]},
        "cost_ms": round((on - off) * 1e3, 2), "cost_share": round((on - off) / off, 4),
        "paired_cost_ms": round(paired * 1e3, 2), "paired_cost_share": round(paired / off, 4),
        "load_average": [round(load, 2) for load in os.getloadavg()],
    }  # fmt: skip


def measure_fit(work: Path, every_n_steps: int) -> tuple[dict[str, Any], Path]:
    """The demo fit's saves, checksums on and off (the first two, which warm up, left out); its last.ckpt."""
    if not DEMO_TRAIN_ROWS.is_file():
        raise FileNotFoundError(f"{DEMO_TRAIN_ROWS} (the demo's data.train) is missing: run `make sample` first")
    root, timings = work / "fit", work / "saves.jsonl"
    shutil.rmtree(root, ignore_errors=True)
    command = [
        sys.executable, "-m", "app", "fit", "--config", "configs/demo.yaml",
        "--data.test", "null", "--data.predict", "null", "--data.cache_dir", str(work / "cache"),
        "--trainer.default_root_dir", str(root), "--trainer.enable_progress_bar", "false",
        "--trainer.callbacks", "app.bench.checkpoint_save.SaveTimer", "--trainer.callbacks.output", str(timings),
        "--checkpoint.every_n_train_steps", str(every_n_steps), "--checkpoint.monitor", "step",
        "--checkpoint.mode", "max", "--checkpoint.save_top_k", "1", "--checkpoint.filename", "{step}",
    ]  # fmt: skip
    subprocess.run(command, check=True, cwd=REPOSITORY)
    records = [json.loads(line) for line in timings.read_text().splitlines()]
    # The first saves warm up; from the third on (off, on, on, off, ...) each pair (2i, 2i + 1) has both arms.
    timed = [(r["checksums"], r["hook_s"]) for r in records[2:]]
    result = summary("demo fit, ModelCheckpoint hook (2 processes)", timed)
    result["saves_per_hook"] = sorted({r["saves"] for r in records})
    return result, root / "checkpoints" / "last.ckpt"


def measure_dcp(case: str, state: dict[str, torch.Tensor], folder: Path, repeats: int) -> dict[str, Any]:
    """``dcp.save`` of ``state`` in this process, DCP's writer against the checksumming one, alternating."""
    timed = []
    for index in range(2 * repeats):
        checksums = index % 4 in (0, 3)
        target = folder / f"save{index}"
        writer = ChecksummingFileSystemWriter(target) if checksums else dcp.FileSystemWriter(target)
        os.sync()  # no save starts while the disk still writes back another's pages
        start = time.perf_counter()
        dcp.save(state, storage_writer=writer)
        timed.append((checksums, time.perf_counter() - start))
        shutil.rmtree(target)
    return summary(case, timed) | {"megabytes": round(_bytes(state) / 1e6, 1)}


def demo_state(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Tensors of the names, shapes and types a demo checkpoint holds (every rank's shards as one)."""
    generator = torch.Generator().manual_seed(0)
    state = {}
    for name, entry in read_checkpoint(checkpoint).index.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            dtype = entry.properties.dtype
            state[name] = torch.randn(tuple(entry.size), generator=generator).to(dtype)
    return state


def bench_tables() -> dict[str, torch.Tensor]:
    count, rows, dimension = BENCH_TABLES
    generator = torch.Generator().manual_seed(0)
    return {f"t_cat_{i}.weight": torch.randn(rows, dimension, generator=generator) for i in range(count)}


def _bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in state.values())


def measure_checkpoint_save(
    work: Path,
    every_n_train_steps: int = 5,
    repeats: int = 100,
    bench_repeats: int = 20,
    dcp_folder: Path | None = None,
    skip_fit: bool = False,
) -> None:
    """What the shard checksums cost a checkpoint save: a demo fit's saves, then ``dcp.save`` alone of the demo's
    tensors and of 26 x 100k x 64 tables; one JSON line each.

    Args:
        work: folder for the fit and the saves (the only place written).
        every_n_train_steps: the fit's save interval, in steps.
        repeats: DCP saves of the demo state per arm.
        bench_repeats: DCP saves of the bench tables per arm.
        dcp_folder: where the DCP-alone saves go (default: under ``work``); e.g. a tmpfs (/dev/shm) to see the
            processor's cost without the disk's.
        skip_fit: only the DCP-alone cases, on the checkpoint of an earlier run's fit under ``work``.
    """
    work = Path(work)
    checkpoint = work / "fit" / "checkpoints" / "last.ckpt"
    if not skip_fit:
        fit, checkpoint = measure_fit(work, every_n_train_steps)
        print(json.dumps(fit), flush=True)
    saves = Path(dcp_folder) if dcp_folder else work / "dcp"
    saves.mkdir(parents=True, exist_ok=True)
    demo = measure_dcp("demo state, dcp.save alone", demo_state(checkpoint), saves, repeats)
    print(json.dumps(demo), flush=True)
    print(json.dumps(measure_dcp("26 x 100k x 64 tables, dcp.save alone", bench_tables(), saves, bench_repeats)))


def main(argv: list[str] | None = None) -> None:
    """``python -m app.bench.checkpoint_save --work DIR`` (``--help``)."""
    status = run_command(measure_checkpoint_save, "python -m app.bench.checkpoint_save", argv)
    if status:
        raise SystemExit(status)


if __name__ == "__main__":
    main()
