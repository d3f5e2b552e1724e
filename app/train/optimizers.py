"""Optimizer choices: the sparse one is fused into the embedding backward, the dense one is ordinary."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import torch
from torch import nn
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from app.compat import fused_supported

SparseOptimizer = Literal["row_wise_adagrad", "adagrad", "sgd", "adam"]
DenseOptimizer = Literal["adagrad", "adam", "sgd"]

# FBGEMM's table-batched embedding kernels implement these natively (TorchRec maps each class to an
# EmbOptimType), so the update runs inside the embedding backward without materialising gradients.
_SPARSE_OPTIMIZER_CLASSES: dict[str, type[torch.optim.Optimizer]] = {
    "row_wise_adagrad": RowWiseAdagrad,
    "adagrad": torch.optim.Adagrad,
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
}
_DENSE_OPTIMIZER_CLASSES: dict[str, type[torch.optim.Optimizer]] = {
    "adagrad": torch.optim.Adagrad,
    "adam": torch.optim.Adam,
    "sgd": torch.optim.SGD,
}


class StepOnceCombinedOptimizer(CombinedOptimizer):
    """A CombinedOptimizer that runs Lightning's closure (forward + backward) exactly once per step.

    TorchRec's CombinedOptimizer hands the closure to every optimizer it holds, so each one that calls
    it would run another forward and backward, and the fused embedding update inside backward would
    happen more than once per step.
    """

    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        super().step()
        return loss


def fastest_implementation(
    optimizer_class: type[torch.optim.Optimizer], params: list[torch.Tensor], **kwargs: Any
) -> torch.optim.Optimizer:
    """``optimizer_class`` with torch's fused kernel where this torch has one for the parameters'
    device type (``app.compat.fused_supported``), else with its default implementation; the update is
    the same either way.

    On CPU the default loops over the parameters tensor by tensor: for the dense part of DLRM the
    fused kernels measured 3x (Adagrad) and 4.5x (Adam) faster, about 2 ms of a 90 ms step of the
    TorchRec reference bench. Decided from the parameters before building, because torch 2.10 and 2.11
    refuse fused Adagrad on CUDA only at the first step. The parameters are on their device by now:
    DMP moved the dense part and the replicated tables there before ``configure_optimizers``.
    """
    device_types = {p.device.type for p in params}
    fused = bool(device_types) and all(
        fused_supported(optimizer_class, device_type, torch.__version__) for device_type in device_types
    )
    return optimizer_class(params, fused=True, **kwargs) if fused else optimizer_class(params, **kwargs)


def _lookup(table: dict[str, type[torch.optim.Optimizer]], name: str, setting: str) -> type[torch.optim.Optimizer]:
    if name not in table:
        raise ValueError(f"{setting} = {name!r} is not one of {', '.join(table)}")
    return table[name]


# FBGEMM's default epsilon for the Adagrad family; the Python optimizers used for replicated tables
# default to 1e-10, so both are given this value and a table trains the same whatever its sharding.
_ADAGRAD_EPS = 1e-8


def sparse_optimizer_kwargs(name: str, learning_rate: float) -> dict[str, float]:
    """Keyword arguments of the sparse optimizer, the same for fused kernels and replicated tables."""
    if name in ("row_wise_adagrad", "adagrad"):
        return {"lr": learning_rate, "eps": _ADAGRAD_EPS}
    return {"lr": learning_rate}


def check_optimizer_names(sparse_optimizer: str, dense_optimizer: str) -> None:
    """Raises a ValueError naming the setting for an unknown optimizer."""
    _lookup(_SPARSE_OPTIMIZER_CLASSES, sparse_optimizer, "model.sparse_optimizer")
    _lookup(_DENSE_OPTIMIZER_CLASSES, dense_optimizer, "model.dense_optimizer")


def fuse_sparse_optimizer(embedding_parameters: Iterable[nn.Parameter], name: str, learning_rate: float) -> None:
    """Marks the embedding parameters so that DMP's sharder builds the optimizer into their backward.

    Note: sharded tables receive the sum over ranks of each rank's mean-loss gradient, as in TorchRec;
    the Adagrad family and Adam are invariant to that scale, plain SGD is not.
    """
    optimizer_class = _lookup(_SPARSE_OPTIMIZER_CLASSES, name, "model.sparse_optimizer")
    apply_optimizer_in_backward(optimizer_class, embedding_parameters, sparse_optimizer_kwargs(name, learning_rate))


def build_optimizer(
    module: nn.Module,
    *,
    table_prefix: str,
    sparse_optimizer: str,
    sparse_learning_rate: float,
    dense_optimizer: str,
    dense_learning_rate: float,
) -> CombinedOptimizer:
    """The optimizer Lightning steps for everything not updated inside backward, keyed by parameter name.

    Tables the planner replicated (data_parallel) come out of DMP as ordinary parameters without the
    fused optimizer, their gradients all-reduced by DDP: they get the sparse optimizer's class and
    learning rate here, so a table trains the same way whichever sharding type it was given. The
    parameters named under ``table_prefix`` are tables; all other remaining ones are dense.
    """
    remaining = dict(in_backward_optimizer_filter(module.named_parameters()))
    replicated_tables = {name: p for name, p in remaining.items() if name.startswith(table_prefix)}
    dense = {name: p for name, p in remaining.items() if not name.startswith(table_prefix)}
    dense_class = _lookup(_DENSE_OPTIMIZER_CLASSES, dense_optimizer, "model.dense_optimizer")
    dense_part = KeyedOptimizerWrapper(dense, lambda params: fastest_implementation(dense_class, params, lr=dense_learning_rate))
    parts = [("dense", dense_part)]
    if replicated_tables:
        table_class = _lookup(_SPARSE_OPTIMIZER_CLASSES, sparse_optimizer, "model.sparse_optimizer")
        table_kwargs = sparse_optimizer_kwargs(sparse_optimizer, sparse_learning_rate)
        tables_part = KeyedOptimizerWrapper(
            replicated_tables, lambda params: fastest_implementation(table_class, params, **table_kwargs)
        )
        parts.append(("replicated_tables", tables_part))
    return CombinedOptimizer(parts)
