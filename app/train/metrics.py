"""Click-prediction metrics, and the set evaluated on the validation and test splits.

Log loss, normalized entropy and calibration are not in torchmetrics: they keep running sums
(constant memory, summed across ranks at compute time), so they are exact on any eval set size. AUC
and accuracy come from torchmetrics: AUC exactly (every prediction kept and gathered) or, for eval
sets too large for that, from a fixed table of thresholds (``binned``).

The exact AUC keeps its predictions in host memory, never on the GPU (where the tables fill the
memory): torchmetrics' ``compute_on_cpu`` moves them there after every update, and they are gathered
through a group that carries CPU tensors (``sync_exact_auc_through``; NCCL carries none). Every
rank then holds and sorts the whole eval set, so ``check_exact_auc_memory`` decides before training
whether the host has the memory for it.

No update makes the host wait for the device (evaluation runs without a host sync per batch on
GPUs): the binned AUC counts with a fixed-size ``index_add_`` (``torch.bincount`` reads the largest
value back to size its output), and torchmetrics' argument checks (``torch.unique`` read back) are
off: the inputs are sigmoid outputs and 0/1 labels by construction.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist
from torchmetrics import Metric, MetricCollection
from torchmetrics.classification import BinaryAccuracy, BinaryAUROC, BinaryAveragePrecision
from torchmetrics.utilities import dim_zero_cat
from torchmetrics.utilities.distributed import gather_all_tensors

EvalMetrics = Literal["exact", "binned"]

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


class Calibration(Metric):
    """Mean predicted click probability divided by the observed click rate: 1 is calibrated, above 1
    over-predicts clicks. A ratio of two sums, so exact across ranks."""

    is_differentiable = False
    full_state_update = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state("probability_sum", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("label_sum", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, probabilities: torch.Tensor, labels: torch.Tensor) -> None:
        """Adds a batch of probabilities in [0, 1] and labels in {0, 1} of the same shape."""
        self.probability_sum += probabilities.detach().double().sum()
        self.label_sum += labels.detach().double().sum()

    def compute(self) -> torch.Tensor:
        return (self.probability_sum / self.label_sum).float()


class BinnedAUROC(BinaryAUROC):
    """torchmetrics' binned ``BinaryAUROC(thresholds=T)``: the same state, sync and compute, with a
    faster update for probabilities in [0, 1] and 0/1 labels.

    Why by hand: torchmetrics compares every prediction with every threshold, O(batch x T) per
    update (44 s for 20,000 predictions and 10,000 thresholds on one CPU core); sorting each
    prediction into its bin and counting is O(batch x log T) and gives the identical table.
    """

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        """Adds a batch of probabilities in [0, 1] and labels in {0, 1} of the same shape."""
        num_thresholds = self.thresholds.numel()
        # Number of thresholds <= p: a prediction counts as positive at thresholds[i] iff it is >= i + 1.
        above = torch.bucketize(preds.detach().float().contiguous(), self.thresholds, right=True)
        bins = above + (num_thresholds + 1) * target.long()
        # What torch.bincount(bins, minlength=...) counts, into a table of fixed size: no host sync.
        counts = torch.zeros(2 * (num_thresholds + 1), dtype=torch.long, device=bins.device)
        counts.index_add_(0, bins, torch.ones_like(bins))
        counts = counts.reshape(2, num_thresholds + 1)  # rows: negatives, positives
        at_or_above = counts.flip(1).cumsum(1).flip(1)[:, 1:]
        below = counts.sum(1, keepdim=True) - at_or_above
        (fp, tp), (tn, fn) = at_or_above, below
        self.confmat += torch.stack([torch.stack([tn, fp], -1), torch.stack([fn, tp], -1)], -2)


class BinnedAveragePrecision(BinaryAveragePrecision):
    """torchmetrics' binned ``BinaryAveragePrecision(thresholds=T)`` (the area under the precision-recall
    curve) counted by :class:`BinnedAUROC`'s update: the same table of counts, so a collection keeps
    one table for both."""

    update = BinnedAUROC.update


class BinnedAUCMaxError(BinnedAUROC):
    """The most the binned AUC of the same predictions can differ from their exact AUC.

    The binned AUC counts every (positive, negative) pair whose predictions fall in the same bin
    between two thresholds as half ordered; the exact AUC counts it 0, 1/2 or 1. So
    ``|binned - exact| <= 1/2 * sum over bins of positives_in_bin * negatives_in_bin / (P * N)``.
    It shares the thresholds table of the binned AUC (same state, computed once in a collection).
    """

    def compute(self) -> torch.Tensor:
        # confmat[i] counts predictions >= thresholds[i]: [[tn, fp], [fn, tp]]
        at_or_above = torch.stack([self.confmat[:, 1, 1], self.confmat[:, 0, 1]]).double()  # positives, negatives
        in_bin = at_or_above - torch.nn.functional.pad(at_or_above[:, 1:], (0, 1))
        positives, negatives = at_or_above[:, 0]
        return (0.5 * (in_bin[0] * in_bin[1]).sum() / (positives * negatives)).float()


def _gather_on_host(tensor: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
    """torchmetrics' gather of one state, from host memory (its empty state of a rank that saw no
    rows is made on the metric's device, the GPU: it too travels through the host group)."""
    return gather_all_tensors(tensor.cpu(), group)


def build_eval_metrics(prefix: str, mode: EvalMetrics = "exact", auc_num_thresholds: int = 10_000) -> MetricCollection:
    """The metrics logged for one split: auc, pr_auc, logloss, ne, calibration, accuracy (+ auc_max_error
    when binned). The AUC and the precision-recall AUC read the same state (the collection's compute
    group): one copy of the predictions (exact) or of the table of counts (binned)."""
    if mode == "exact":
        # Keeps every prediction in host memory and gathers them across ranks: for eval sets that fit there.
        exact = BinaryAUROC(compute_on_cpu=True, dist_sync_fn=_gather_on_host, validate_args=False)
        auc: dict[str, Metric] = {"auc": exact, "pr_auc": precision_recall_auc()}
    elif mode == "binned":
        if auc_num_thresholds < 2:
            raise ValueError(f"model.auc_num_thresholds = {auc_num_thresholds}: needs at least 2 thresholds")
        # A (thresholds x 2 x 2) table of counts, summed across ranks: constant memory for any eval set.
        auc = {
            "auc": BinnedAUROC(thresholds=auc_num_thresholds),
            "auc_max_error": BinnedAUCMaxError(thresholds=auc_num_thresholds),
            "pr_auc": BinnedAveragePrecision(thresholds=auc_num_thresholds),
        }
    else:
        raise ValueError(f"model.eval_metrics = {mode!r}: use exact or binned")
    sums = {
        "logloss": LogLoss(),
        "ne": NormalizedEntropy(),
        "calibration": Calibration(),
        "accuracy": BinaryAccuracy(validate_args=False),
    }
    return MetricCollection({**auc, **sums}, prefix=prefix)


def sync_exact_auc_through(metrics: MetricCollection, group: dist.ProcessGroup | None) -> None:
    """Gathers the metrics that keep their states in host memory through ``group`` (None: the
    default group), which must carry CPU tensors (``app.train.host_group.host_process_group``)."""
    for metric in metrics.values():
        if metric.compute_on_cpu:
            metric.process_group = group


# Host memory the exact AUC takes per eval row on every rank, at its peak: measured with
# ru_maxrss around torchmetrics' compute of 5M rows on CPU (torch 2.13, torchmetrics 1.9): 12 B of
# state (float32 prediction, int64 label), 65 B more while it sorts; rounded up for the gathered copy.
EXACT_AUC_HOST_BYTES_PER_ROW = 80
# Above this per rank, a warning says what exact AUC costs and that binned does not.
EXACT_AUC_WARN_BYTES = 1 << 30


def check_exact_auc_memory(
    num_rows: int, split: str, ranks_on_host: int, available_host_bytes: int | None
) -> str | None:
    """Whether the host can hold the exact AUC of ``num_rows`` eval rows (of ``data.<split>``).

    Every rank gathers and sorts all rows, so the host needs ``ranks_on_host`` times one rank's share.

    Returns:
        A warning to print when one rank needs more than ``EXACT_AUC_WARN_BYTES``, else None.

    Raises:
        ValueError: naming ``model.eval_metrics`` when the host's ranks need more than
            ``available_host_bytes`` (None: not known, no refusal).
    """
    per_rank_bytes = num_rows * EXACT_AUC_HOST_BYTES_PER_ROW
    host_bytes = per_rank_bytes * ranks_on_host
    cost = (
        f"model.eval_metrics = exact: every rank gathers and sorts the {num_rows:,} rows of data.{split} in host "
        f"memory at each evaluation, about {per_rank_bytes / 2**30:.1f} GiB per rank, "
        f"{host_bytes / 2**30:.1f} GiB for the {ranks_on_host} ranks of this machine"
    )
    advice = "model.eval_metrics: binned takes constant memory and logs its error bound (auc_max_error)"
    if available_host_bytes is not None and host_bytes > available_host_bytes:
        raise ValueError(f"{cost}, more than the {available_host_bytes / 2**30:.1f} GiB available; {advice}")
    if per_rank_bytes > EXACT_AUC_WARN_BYTES:
        return f"{cost}; {advice}"
    return None


def available_host_bytes() -> int | None:
    """Host memory the kernel can still hand out (MemAvailable: free plus reclaimable page cache,
    which the memory-mapped data fills); None where /proc/meminfo does not say."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return None


def group_auc(probabilities: np.ndarray, labels: np.ndarray, groups: np.ndarray) -> float:
    """GAUC: the mean of each group's AUC weighted by the group's rows, over the groups with both labels
    (NaN when none has). Each group's AUC is the rank-sum statistic with tied predictions given their
    mean rank, the exact AUC (``BinaryAUROC``) of the group's rows; one sort of all rows by (group, p)."""
    order = np.lexsort((probabilities, groups))
    p, y, g = probabilities[order].astype(np.float64), labels[order].astype(np.float64), groups[order]
    num_rows = p.size
    if num_rows == 0:
        return float("nan")
    new_group = np.r_[True, g[1:] != g[:-1]]
    group_of_row = np.cumsum(new_group) - 1
    group_start = np.flatnonzero(new_group)
    new_tie = new_group | np.r_[True, p[1:] != p[:-1]]  # a run of equal predictions inside one group
    tie_of_row = np.cumsum(new_tie) - 1
    tie_start = np.flatnonzero(new_tie)
    tie_stop = np.r_[tie_start[1:], num_rows]
    # 1-based rank inside the group, the mean over the tie: positions start .. stop - 1.
    mean_rank = (tie_start + tie_stop - 1) / 2 + 1 - group_start[group_of_row[tie_start]]
    rows = np.bincount(group_of_row).astype(np.float64)
    positives = np.bincount(group_of_row, weights=y)
    negatives = rows - positives
    positive_rank_sum = np.bincount(group_of_row, weights=mean_rank[tie_of_row] * y)
    both = (positives > 0) & (negatives > 0)
    if not both.any():
        return float("nan")
    pos, neg = positives[both], negatives[both]
    auc = (positive_rank_sum[both] - pos * (pos + 1) / 2) / (pos * neg)
    return float((auc * rows[both]).sum() / rows[both].sum())


class GroupAUC(Metric):
    """GAUC (per-group AUC, e.g. per user; :func:`group_auc`), exact across ranks: every rank keeps its
    rows' predictions, labels and group ids, and compute gathers them all, so a group whose rows sit
    on several ranks counts as one group. States live in host memory (``compute_on_cpu``) like the
    exact AUC's; 20 bytes per row (float32 prediction, int64 label and group). Written here because
    torchmetrics' per-group AUC (``RetrievalAUROC``) averages the groups unweighted, and GAUC weights
    each group by its rows."""

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    def __init__(self, **kwargs) -> None:
        kwargs.setdefault("compute_on_cpu", True)
        kwargs.setdefault("dist_sync_fn", _gather_on_host)
        super().__init__(**kwargs)
        self.add_state("probabilities", default=[], dist_reduce_fx="cat")
        self.add_state("labels", default=[], dist_reduce_fx="cat")
        self.add_state("groups", default=[], dist_reduce_fx="cat")

    def update(self, probabilities: torch.Tensor, labels: torch.Tensor, groups: torch.Tensor) -> None:
        """Adds a batch of probabilities in [0, 1], 0/1 labels and integer group ids of the same shape."""
        self.probabilities.append(probabilities.detach().float())
        self.labels.append(labels.detach().long())
        self.groups.append(groups.detach().long())

    def compute(self) -> torch.Tensor:
        p, y, g = (dim_zero_cat(state).cpu().numpy() for state in (self.probabilities, self.labels, self.groups))
        return torch.tensor(group_auc(p, y, g), dtype=torch.float32)


def precision_recall_auc(**kwargs: Any) -> Metric:
    """The area under the precision-recall curve as average precision (precision at each distinct
    threshold weighted by the recall it adds: scikit-learn's ``average_precision_score``), exact
    across ranks: the predictions are kept in host memory and gathered, as for the exact AUC."""
    return BinaryAveragePrecision(compute_on_cpu=True, dist_sync_fn=_gather_on_host, validate_args=False, **kwargs)
