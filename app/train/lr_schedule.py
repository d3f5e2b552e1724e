"""Learning-rate schedule of MLPerf DLRMv2: linear warm-up, constant, then polynomial decay.

With ``k`` the number of optimizer steps already taken (0 for the first step), the learning rate of
every parameter group is its base rate times

    (k + 1) / lr_warmup_steps                                     while k < lr_warmup_steps
    max(lr_decay_end_factor, ((s + n - k) / n) ** lr_decay_power) while s <= k < s + n
    lr_decay_end_factor                                           once k >= s + n
    1                                                             otherwise

where s = ``lr_decay_start`` and n = ``lr_decay_steps`` (MLPerf's reference uses power 2).

The same factor applies to the dense optimizer and to TorchRec's fused embedding optimizer: both sit
in the one combined optimizer the strategy steps, and a fused embedding optimizer hands its
``param_groups[0]["lr"]`` to the FBGEMM kernel on every ``zero_grad()`` and ``step()``, so a scheduler
that edits the param groups drives the embedding update too, provided the kernel has the rate before
the step's forward (FBGEMM's CPU kernels take it there; the plain loop hands it over explicitly:
``DLRMModule.training_step``). Under automatic optimization Lightning steps the scheduler after each
optimizer step; a loop that optimizes manually (``model.pipeline``) calls ``step_lr_schedulers`` after
each step instead. A resumed run takes the groups' rates from the restored scheduler
(``restore_scheduled_rates``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lightning.pytorch import LightningModule
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR, LRScheduler


@dataclass(frozen=True)
class LRSchedule:
    """The schedule's settings (see the module docstring); all zero means a constant learning rate."""

    warmup_steps: int = 0
    decay_start: int = 0
    decay_steps: int = 0
    decay_power: float = 2.0
    decay_end_factor: float = 0.0

    def __post_init__(self) -> None:
        for name in ("warmup_steps", "decay_start", "decay_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"model.lr_{name} = {getattr(self, name)} must not be negative")
        if self.decay_steps and self.decay_start < self.warmup_steps:
            raise ValueError(
                f"model.lr_decay_start = {self.decay_start} is inside the warm-up (model.lr_warmup_steps = "
                f"{self.warmup_steps}): the decay must start after it"
            )
        if not (math.isfinite(self.decay_power) and self.decay_power > 0):  # a negative one divides by 0 at the end
            raise ValueError(f"model.lr_decay_power = {self.decay_power} must be a number > 0")
        if not 0.0 <= self.decay_end_factor <= 1.0:
            raise ValueError(f"model.lr_decay_end_factor = {self.decay_end_factor} must be within [0, 1]")

    @property
    def is_constant(self) -> bool:
        return self.warmup_steps == 0 and self.decay_steps == 0

    def factor(self, step: int) -> float:
        """Multiplier of the base learning rate for the step that follows ``step`` completed steps."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.decay_steps and step >= self.decay_start:
            remaining = max(0, self.decay_start + self.decay_steps - step)
            return max(self.decay_end_factor, (remaining / self.decay_steps) ** self.decay_power)
        return 1.0

    # LambdaLR calls this with its step count, which Lightning advances once per optimizer step.
    __call__ = factor


def lr_scheduler_config(optimizer: Optimizer, schedule: LRSchedule) -> dict[str, Any]:
    """The ``lr_scheduler`` entry of ``configure_optimizers``: stepped by Lightning after every optimizer step."""
    return {"scheduler": LambdaLR(optimizer, schedule), "interval": "step", "frequency": 1}


def move_scheduler(scheduler: LRScheduler, optimizer: Optimizer) -> LRScheduler:
    """The same schedule on ``optimizer``: for a strategy that puts the optimizer the module returned
    inside a larger one (TorchRecStrategy adds the fused embedding optimizer), so that the schedule
    reaches every parameter group of what is actually stepped."""
    if not isinstance(scheduler, LambdaLR) or not isinstance(scheduler.lr_lambdas[0], LRSchedule):
        raise TypeError(
            f"the strategy can carry over the app's LRSchedule only, not {type(scheduler).__name__}: "
            "set the schedule through model.lr_* settings"
        )
    # Built at set-up, before any step: the base rates of the groups it already knew are kept in
    # their "initial_lr"; the added groups' current rates are their base rates.
    return LambdaLR(optimizer, scheduler.lr_lambdas[0])


def step_lr_schedulers(module: LightningModule, interval: str) -> None:
    """Steps the module's LR schedulers of ``interval`` (``step`` or ``epoch``).

    Under manual optimization Lightning leaves this to the module; the plain loop's automatic
    optimization does it after every optimizer step. Plateau schedulers need a metric and are left out.
    """
    trainer = module.trainer
    count = trainer.global_step if interval == "step" else trainer.current_epoch + 1
    for config in trainer.lr_scheduler_configs:
        if config.interval == interval and not config.reduce_on_plateau and count % config.frequency == 0:
            config.scheduler.step()



def restore_scheduled_rates(module: LightningModule) -> None:
    """Sets every parameter group's rate to the one its scheduler holds for the next step.

    A resumed run restores the scheduler's state (its step count and ``get_last_lr()``, the next
    step's rates) but not the rates in the optimizer's groups: the checkpoint keeps the optimizer's
    tensors only (app/checkpoint/format.py), and ``LambdaLR.load_state_dict`` restores the count
    without touching the groups, which keep the first step's rate that ``LambdaLR`` set when it was
    built. Called once the state is restored, before the first step (a fresh run: no change); the
    fused embedding optimizer hands its group's rate to FBGEMM at that step's ``zero_grad()``.
    """
    for config in module.trainer.lr_scheduler_configs:
        scheduler = config.scheduler
        for group, rate in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr(), strict=True):
            group["lr"] = rate
