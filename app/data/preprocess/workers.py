"""Running tasks (one input file each) on spawned worker processes, or in this process, with one
progress bar of the rows parsed."""

from __future__ import annotations

import multiprocessing
import queue
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

from tqdm import tqdm

from app.data.preprocess.config import DayTask

# Where a worker reports parsed rows: the main process's progress queue, or a callback when the
# work runs in the main process itself.
_report_rows: Callable[[int], None] = lambda rows: None


def _init_worker(progress: multiprocessing.Queue) -> None:
    global _report_rows
    _report_rows = progress.put


def report_rows(rows: int) -> None:
    """Count ``rows`` more parsed rows on the progress bar (called by the tasks, in any process)."""
    _report_rows(rows)


def run_tasks(function: Callable, tasks: Sequence[DayTask], workers: int, description: str, progress: bool) -> list:
    """``function(task)`` for every task, in task order; spawned worker processes when ``workers`` > 1."""
    global _report_rows
    if not tasks:
        return []
    bar = tqdm(desc=description, unit=" rows", unit_scale=True, mininterval=1.0, disable=not progress, file=sys.stderr)
    try:
        if workers <= 1 or len(tasks) <= 1:
            _report_rows = bar.update
            try:
                return [function(task) for task in tasks]
            finally:
                _report_rows = lambda rows: None
        return _run_in_pool(function, tasks, workers, bar)
    finally:
        bar.close()


def _run_in_pool(function: Callable, tasks: Sequence[DayTask], workers: int, bar: tqdm) -> list:
    context = multiprocessing.get_context("spawn")  # fork would copy the parent's threads and memory
    progress = context.Queue()
    with ProcessPoolExecutor(min(workers, len(tasks)), context, _init_worker, (progress,)) as pool:
        futures = [pool.submit(function, task) for task in tasks]
        pending = set(futures)
        try:
            while pending:
                done, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
                _drain(progress, bar)
                for future in done:
                    future.result()  # a worker's error stops the run now
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        _drain(progress, bar)
        return [future.result() for future in futures]


def _drain(progress: multiprocessing.Queue, bar: tqdm) -> None:
    while True:
        try:
            bar.update(progress.get_nowait())
        except queue.Empty:
            return
