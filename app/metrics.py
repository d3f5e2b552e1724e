"""Click-prediction metrics that torchmetrics lacks: log loss and normalized entropy.

Both keep running sums (constant memory, summed across ranks at compute time), so they are exact on
any eval set size. AUC and accuracy come from torchmetrics as they are.
"""

from __future__ import annotations

import torch
from torchmetrics import Metric

# Probabilities are clamped away from 0 and 1 so that one confident mistake cannot make the loss inf.
_EPS = 1e-7


class LogLoss(Metric):
    """Mean binary cross-entropy of predicted click probabilities against 0/1 labels."""

    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state("cross_entropy_sum", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("num_positives", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("num_samples", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, probabilities: torch.Tensor, labels: torch.Tensor) -> None:
        """Adds a batch of probabilities in [0, 1] and labels in {0, 1} of the same shape."""
        p = probabilities.detach().double().clamp(_EPS, 1 - _EPS)
        y = labels.detach().double()
        self.cross_entropy_sum += -(y * p.log() + (1 - y) * (1 - p).log()).sum()
        self.num_positives += y.sum()
        self.num_samples += y.numel()

    def compute(self) -> torch.Tensor:
        return (self.cross_entropy_sum / self.num_samples).float()


class NormalizedEntropy(LogLoss):
    """Log loss divided by the entropy of the base click rate (He et al., 2014): below 1 beats a constant."""

    def compute(self) -> torch.Tensor:
        base_rate = (self.num_positives / self.num_samples).clamp(_EPS, 1 - _EPS)
        base_entropy = -(base_rate * base_rate.log() + (1 - base_rate) * (1 - base_rate).log())
        return (self.cross_entropy_sum / self.num_samples / base_entropy).float()
