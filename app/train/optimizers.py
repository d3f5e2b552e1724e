"""Optimizer choices: the sparse one is fused into the embedding backward, the dense one is ordinary."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Literal

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_training import WeightDecayMode
from torch import nn
from torchrec import optim as torchrec_optim
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from app.compat import fused_supported

SparseOptimizer = Literal["row_wise_adagrad", "adagrad", "sgd", "adam"]
DenseOptimizer = Literal["adagrad", "adam", "sgd"]
# ``l2``: the decay times the weight is added to the gradient, so it also enters the optimizer's state
# (Adagrad's accumulator, Adam's moments). ``decoupled``: the weight is scaled by 1 - lr * decay next to
# the optimizer's step, outside its state (Loshchilov & Hutter; AdamW).
WeightDecayModeName = Literal["l2", "decoupled"]
_WEIGHT_DECAY_MODES = ("l2", "decoupled")

# FBGEMM's table-batched embedding kernels implement these natively (TorchRec maps each class to an
# EmbOptimType), so the update runs inside the embedding backward without materialising gradients.
_SPARSE_OPTIMIZER_CLASSES: dict[str, type[torch.optim.Optimizer]] = {
    "row_wise_adagrad": RowWiseAdagrad,
    "adagrad": torch.optim.Adagrad,
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
}
# The classes handed to ``apply_optimizer_in_backward`` for the fused kernels. It builds one on each
# table's parameter with FBGEMM's keyword arguments, which torch's Adam refuses (``weight_decay_mode``:
# "unexpected keyword argument", seen on an H200); TorchRec's placeholder Adam takes them and maps to the
# same EmbOptimType.ADAM (torchrec/distributed/utils.py). Replicated tables keep torch's Adam above: their
# update is a real step, which the placeholder cannot take.
_FUSED_OPTIMIZER_CLASSES: dict[str, type[torch.optim.Optimizer]] = _SPARSE_OPTIMIZER_CLASSES | {"adam": torchrec_optim.Adam}
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


# The weight-decay modes each sparse optimizer's FBGEMM kernel applies (fbgemm_gpu's
# codegen/genscript/optimizers.py; TorchRec hands ``weight_decay`` and ``weight_decay_mode`` through to
# SplitTableBatchedEmbeddingBagsCodegen unchanged). EXACT_ROWWISE_ADAGRAD reads ``weight_decay_mode``:
# L2 adds decay * w to the row's gradient before its accumulator, DECOUPLE scales the row by
# 1 - lr * decay (in its GPU kernels; its CPU kernel drops both: check_sparse_weight_decay_device).
# ADAM (GPUs only) always decouples (w -= lr * (m / (sqrt(v) + eps) + decay * w)) whatever the mode.
# The EXACT_ADAGRAD and EXACT_SGD invokers never pass ``weight_decay`` to their kernels: a decay given
# to them would be dropped without a word, hence refused.
_SPARSE_WEIGHT_DECAY_MODES: dict[str, tuple[str, ...]] = {
    "row_wise_adagrad": ("l2", "decoupled"),
    "adam": ("decoupled",),
    "adagrad": (),
    "sgd": (),
}
_FBGEMM_WEIGHT_DECAY_MODES = {"l2": WeightDecayMode.L2, "decoupled": WeightDecayMode.DECOUPLE}
# torch's optimizers: Adagrad's weight_decay is L2 only; Adam has both (decoupled_weight_decay=True is
# AdamW); plain SGD's L2 step w - lr * (g + decay * w) is the decoupled one as well.
_DENSE_WEIGHT_DECAY_MODES: dict[str, tuple[str, ...]] = {
    "adagrad": ("l2",),
    "adam": ("l2", "decoupled"),
    "sgd": ("l2", "decoupled"),
}


def check_learning_rates(sparse_learning_rate: float, dense_learning_rate: float) -> None:
    """Raises a ValueError naming ``model.sparse_learning_rate`` or ``model.dense_learning_rate`` when it is
    not a finite number > 0 (torch's own message, "Invalid learning rate", names no setting, and FBGEMM's
    kernels take a negative rate without a word)."""
    for setting, value in (("model.sparse_learning_rate", sparse_learning_rate), ("model.dense_learning_rate", dense_learning_rate)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ValueError(f"{setting} = {value} must be a number > 0")


def check_weight_decay(
    sparse_optimizer: str,
    sparse_weight_decay: float,
    sparse_weight_decay_mode: str,
    dense_optimizer: str,
    dense_weight_decay: float,
    dense_weight_decay_mode: str,
) -> None:
    """Raises a ValueError naming the setting for a negative decay, an unknown mode, or a decay or mode
    the chosen optimizer's kernel does not apply (called with known optimizer names)."""
    for part, optimizer, weight_decay, mode, modes, library in (
        ("sparse", sparse_optimizer, sparse_weight_decay, sparse_weight_decay_mode, _SPARSE_WEIGHT_DECAY_MODES, "FBGEMM"),
        ("dense", dense_optimizer, dense_weight_decay, dense_weight_decay_mode, _DENSE_WEIGHT_DECAY_MODES, "torch"),
    ):
        setting = f"model.{part}_weight_decay"
        if not (math.isfinite(weight_decay) and weight_decay >= 0):
            raise ValueError(f"{setting} = {weight_decay} must be a number >= 0 (0: no weight decay)")
        if mode not in _WEIGHT_DECAY_MODES:
            raise ValueError(f"{setting}_mode = {mode!r} is not one of {', '.join(_WEIGHT_DECAY_MODES)}")
        if weight_decay == 0:
            continue
        supported = modes[optimizer]
        if not supported:
            offered = ", ".join(name for name, names in modes.items() if names)
            raise ValueError(
                f"{setting} = {weight_decay}: {library}'s {optimizer} kernel has no weight decay "
                f"(model.{part}_optimizer {offered} have one), so it would be ignored"
            )
        if mode not in supported:
            raise ValueError(
                f"{setting}_mode = {mode}: {library}'s {optimizer} has only {' and '.join(supported)} weight decay"
            )


def check_sparse_weight_decay_device(sparse_weight_decay: float, device_type: str) -> None:
    """Refuses sparse weight decay on CPU, naming the setting: FBGEMM's CPU kernels would drop it.

    FBGEMM's CPU backward for row-wise Adagrad (codegen/training/backward/
    embedding_backward_split_cpu_template.cpp) takes a fast path for fp32 tables that serve one feature,
    which every table of this app is, and calls fbgemm's SparseAdaGrad with ``weight_decay=0``: neither
    mode applies there (its GPU kernels apply both). The other CPU kernels (adagrad, sgd) have no decay
    at all. tests/train/test_weight_decay.py keeps the observation true for the installed FBGEMM.
    """
    if sparse_weight_decay and device_type == "cpu":
        raise ValueError(
            f"model.sparse_weight_decay = {sparse_weight_decay}: FBGEMM's CPU embedding kernels drop the decay "
            "(row-wise Adagrad's fp32 path applies none), so it would be ignored; train on GPUs or set it to 0"
        )


def fused_weight_decay_kwargs(weight_decay: float, mode: str) -> dict[str, Any]:
    """FBGEMM's weight-decay arguments of the fused embedding kernels; none when there is no decay, so
    that the kernels are built exactly as without this setting."""
    if weight_decay == 0:
        return {}
    return {"weight_decay": weight_decay, "weight_decay_mode": _FBGEMM_WEIGHT_DECAY_MODES[mode]}


def dense_weight_decay_kwargs(optimizer: str, weight_decay: float, mode: str) -> dict[str, Any]:
    """torch's weight-decay arguments of the dense optimizer (checked by ``check_weight_decay``)."""
    if weight_decay == 0:
        return {}
    if optimizer == "adam" and mode == "decoupled":
        return {"weight_decay": weight_decay, "decoupled_weight_decay": True}  # AdamW, with Adam's fused kernel
    return {"weight_decay": weight_decay}


def fuse_sparse_optimizer(
    embedding_parameters: Iterable[nn.Parameter],
    name: str,
    learning_rate: float,
    weight_decay: float = 0.0,
    weight_decay_mode: str = "l2",
) -> None:
    """Marks the embedding parameters so that DMP's sharder builds the optimizer into their backward.

    The weight decay goes to FBGEMM's kernel with the optimizer's other arguments; the kernel applies
    it to the rows a batch looks up, at that step (other rows keep their values).

    Note: sharded tables receive the sum over ranks of each rank's mean-loss gradient, as in TorchRec;
    the Adagrad family and Adam are invariant to that scale, plain SGD is not, and neither is L2 weight
    decay, which is added to that sum: with N processes it pulls 1/N as hard against the gradient.
    """
    optimizer_class = _lookup(_FUSED_OPTIMIZER_CLASSES, name, "model.sparse_optimizer")
    kwargs = sparse_optimizer_kwargs(name, learning_rate) | fused_weight_decay_kwargs(weight_decay, weight_decay_mode)
    apply_optimizer_in_backward(optimizer_class, embedding_parameters, kwargs)


def check_no_replicated_table_decays(replicated_table_names: Iterable[str], sparse_weight_decay: float) -> None:
    """Refuses sparse weight decay on tables the planner replicated (data_parallel), naming the setting.

    Their update is a torch optimizer's step over the whole table: it would decay every row at every
    step, where FBGEMM's kernels decay only the rows a batch looks up; and DDP averages their gradient
    over ranks, where sharded tables receive the sum, which changes what L2 decay weighs against. No
    torch optimizer applies decay to the looked-up rows only, so the table would train differently
    from a sharded one: refused rather than approximated by a hand-written update.
    """
    names = sorted(replicated_table_names)
    if sparse_weight_decay and names:
        raise ValueError(
            f"model.sparse_weight_decay = {sparse_weight_decay}: the planner replicated {', '.join(names)} "
            "(data_parallel), whose torch optimizer would decay every row at every step where FBGEMM's kernels "
            "decay only the rows a batch looks up; leave data_parallel out of trainer.strategy.sharding_types "
            "and table_constraints, or set model.sparse_weight_decay to 0"
        )


def build_optimizer(
    module: nn.Module,
    *,
    table_prefix: str,
    sparse_optimizer: str,
    sparse_learning_rate: float,
    dense_optimizer: str,
    dense_learning_rate: float,
    sparse_weight_decay: float = 0.0,
    dense_weight_decay: float = 0.0,
    dense_weight_decay_mode: str = "l2",
) -> CombinedOptimizer:
    """The optimizer Lightning steps for everything not updated inside backward, keyed by parameter name.

    Tables the planner replicated (data_parallel) come out of DMP as ordinary parameters without the
    fused optimizer, their gradients all-reduced by DDP: they get the sparse optimizer's class and
    learning rate here, so a table trains the same way whichever sharding type it was given (and no
    weight decay: ``check_no_replicated_table_decays``). The parameters named under ``table_prefix`` are
    tables; all other remaining ones are dense.
    """
    remaining = dict(in_backward_optimizer_filter(module.named_parameters()))
    replicated_tables = {name: p for name, p in remaining.items() if name.startswith(table_prefix)}
    check_no_replicated_table_decays(map(_table_name, replicated_tables), sparse_weight_decay)
    dense = {name: p for name, p in remaining.items() if not name.startswith(table_prefix)}
    dense_class = _lookup(_DENSE_OPTIMIZER_CLASSES, dense_optimizer, "model.dense_optimizer")
    dense_kwargs = {"lr": dense_learning_rate} | dense_weight_decay_kwargs(
        dense_optimizer, dense_weight_decay, dense_weight_decay_mode
    )
    dense_part = KeyedOptimizerWrapper(dense, lambda params: fastest_implementation(dense_class, params, **dense_kwargs))
    parts = [("dense", dense_part)]
    if replicated_tables:
        table_class = _lookup(_SPARSE_OPTIMIZER_CLASSES, sparse_optimizer, "model.sparse_optimizer")
        table_kwargs = sparse_optimizer_kwargs(sparse_optimizer, sparse_learning_rate)
        tables_part = KeyedOptimizerWrapper(
            replicated_tables, lambda params: fastest_implementation(table_class, params, **table_kwargs)
        )
        parts.append(("replicated_tables", tables_part))
    return CombinedOptimizer(parts)


def _table_name(parameter_name: str) -> str:
    """``t_cat_3`` for ``model.sparse_arch.embedding_bag_collection.embedding_bags.t_cat_3.weight``."""
    parts = parameter_name.split(".")
    return parts[-2] if len(parts) > 1 and parts[-1] == "weight" else parameter_name


def dense_layers_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The part of ``optimizer`` that updates the dense layers: the ``dense`` entry of ``build_optimizer``'s
    combined optimizer, itself the ``dense`` entry of the strategy's (beside the fused ``sparse`` one);
    ``optimizer`` itself when it is neither."""
    while isinstance(optimizer, CombinedOptimizer) and "dense" in dict(optimizer.optimizers):
        optimizer = dict(optimizer.optimizers)["dense"]
    return optimizer
