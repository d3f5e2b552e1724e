"""The ``--early_stopping.*`` group: Lightning's ``EarlyStopping``, off unless a metric to watch is named."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import EarlyStopping


class EarlyStoppingWhenAsked(EarlyStopping):
    """Lightning's ``EarlyStopping``: fit stops once the monitored metric has not improved for ``patience``
    validations in a row. Off unless ``monitor`` is set.

    Lightning's class requires a metric, which would make every run name one; here none (the default)
    means off, and the CLI then leaves the callback out of the trainer. Every validation counts, so with
    ``trainer.val_check_interval`` N steps fit may stop in the middle of an epoch, after the validation
    that used up the patience.

    Args:
        monitor: the logged metric to watch, e.g. ``val/auc`` or ``val/logloss``; null (the default): off.
        mode: ``max`` for a metric that should rise (``val/auc``), ``min`` for one that should fall (a loss).
    """

    def __init__(self, monitor: str | None = None, mode: str = "min", **kwargs: Any) -> None:
        # Lightning raises MisconfigurationException, which the CLI would show as a traceback.
        if mode not in self.mode_dict:
            raise ValueError(f"early_stopping.mode = {mode!r}: use min or max")
        super().__init__(monitor=monitor, mode=mode, **kwargs)  # type: ignore[arg-type]

    @property
    def enabled(self) -> bool:
        """Whether a metric to watch was named."""
        return self.monitor is not None
