"""Health of a multi-process run in the logs: per-rank step times, a warning for a straggling rank,
and a pointer to the other ranks' logs when a collective fails."""

from __future__ import annotations

import sys
import time
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_warn


class RankHealth(Callback):
    """Logs each rank's step time and warns when one rank is much slower than the others.

    Every ``every_n_steps`` training steps the ranks all-gather two numbers (one tiny collective):
    ``health/step_ms`` is the wall time per step (the same on every rank, since each step's
    collectives wait for the slowest), and ``health/between_steps_ms/rank{R}`` the time rank R spent
    between its steps (loading its next batch, callbacks): the part no collective evens out, where a
    rank with slow storage, a busy CPU or a late data loader shows up.

    Args:
        every_n_steps: steps between two gathers (default: ``trainer.log_every_n_steps``).
        slow_rank_factor: warn when a rank's time between steps exceeds this many times the median
            over ranks ...
        slow_rank_min_ms: ... and exceeds the median by at least this many milliseconds (ignores
            differences too small to matter).
    """

    def __init__(
        self, every_n_steps: int | None = None, slow_rank_factor: float = 2.0, slow_rank_min_ms: float = 50.0
    ) -> None:
        if slow_rank_factor <= 1:
            raise ValueError(f"rank_health.slow_rank_factor = {slow_rank_factor}: must be > 1")
        self.every_n_steps = every_n_steps
        self.slow_rank_factor = slow_rank_factor
        self.slow_rank_min_ms = slow_rank_min_ms
        self._last_end_s: float | None = None
        self._window_start_s = 0.0
        self._between_s = 0.0
        self._gaps = 0  # the gaps measured in _between_s
        self._steps = 0

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._last_end_s = None  # the time across an epoch boundary or a validation is no step's
        self._reset()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.on_train_epoch_start(trainer, pl_module)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        now = time.perf_counter()
        if self._last_end_s is not None:
            self._between_s += now - self._last_end_s
            self._gaps += 1

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._last_end_s = time.perf_counter()
        self._steps += 1
        if self._steps >= (self.every_n_steps or trainer.log_every_n_steps) and trainer.world_size > 1:
            self._report(trainer, pl_module)

    def _reset(self) -> None:
        self._window_start_s = time.perf_counter()
        self._between_s = 0.0
        self._gaps = 0
        self._steps = 0

    def _report(self, trainer: Trainer, pl_module: LightningModule) -> None:
        step_ms = 1e3 * (time.perf_counter() - self._window_start_s) / self._steps
        # Averaged over the gaps measured: the first window of an epoch has one gap fewer than steps, the
        # later ones (whose first step follows the previous window's last) as many as steps.
        between_ms = 1e3 * self._between_s / max(self._gaps, 1)
        mine = torch.tensor([step_ms, between_ms], dtype=torch.float64, device=pl_module.device)
        every = pl_module.all_gather(mine).cpu()  # (world_size, 2), on every rank
        self._reset()
        if trainer.is_global_zero:
            # Straight to the loggers: these steps need not be the ones Lightning's self.log writes at.
            metrics = {"health/step_ms": float(every[:, 0].max())}
            metrics.update({f"health/between_steps_ms/rank{r}": v for r, v in enumerate(every[:, 1].tolist())})
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
        median_ms = float(every[:, 1].median())
        slowest = int(every[:, 1].argmax())
        slowest_ms = float(every[slowest, 1])
        if slowest_ms > self.slow_rank_factor * median_ms and slowest_ms - median_ms > self.slow_rank_min_ms:
            rank_zero_warn(
                f"slow rank: rank {slowest} spends {slowest_ms:.0f} ms between steps, the median rank "
                f"{median_ms:.0f} ms (step {trainer.global_step}; every step waits for it, {step_ms:.0f} ms per "
                f"step): check its node's data loading, CPU and GPU "
                f"(rank_health.slow_rank_factor = {self.slow_rank_factor})"
            )

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        # A collective that fails here usually failed because of another rank: say where to look.
        if trainer.world_size > 1 and isinstance(exception, RuntimeError):
            print(
                f"rank {trainer.global_rank}: {type(exception).__name__} during a run of {trainer.world_size} ranks; "
                "if it names a connection, a closed pair or a timeout, another rank died or stalled longer than "
                "trainer.strategy.init_args.timeout_s (barrier_timeout_s at a barrier, e.g. around a checkpoint; "
                "a monitoredBarrier error names the ranks): its log has the cause",
                file=sys.stderr,
            )
