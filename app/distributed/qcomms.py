"""Compressed communication: TorchRec's quantized comms for the embedding all-to-alls.

TorchRec's sharders take a registry of FBGEMM codecs (``QCommsConfig`` -> ``get_qcomm_codecs_registry``)
that quantize the pooled embeddings before the all-to-all that carries them to the ranks that need them
(and the reduce-scatter of row-wise sharding), and their gradients on the way back; the codec runs on the
sending side and decodes on the receiving one (torchrec/distributed/dist_data.py,
``PooledEmbeddingsAllToAll(codecs=...)``). The forward all-to-all sits on every step's critical path: on a
bandwidth-bound link, half the bytes is about half its time. The input all-to-all (the ids) is not
compressed: ids are integers.

Precisions by backend (decided before any worker starts):

- NCCL (GPUs): fp16, bf16 and fp8 (forward) as TorchRec offers them.
- gloo (CPU): fp16 only. TorchRec itself swaps bf16 for fp16 on gloo with a warning
  (torchrec/distributed/fbgemm_qcomm_codec.py, ``get_qcomm_codecs_registry``): asked by name, it is refused
  instead, so that a run never trains in a precision other than the one its config names. fp8 and the other
  integer formats have no CPU path the app has tested.

Example (``python -m app fit ... --trainer.strategy.init_args.qcomms``)::

    qcomms: {forward_precision: fp16, backward_precision: fp16}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig, get_qcomm_codecs_registry
from torchrec.distributed.types import ModuleSharder

from app.distributed.sharding import default_sharders

Precision = Literal["fp32", "fp16", "bf16", "fp8"]
SETTING = "trainer.strategy.init_args.qcomms"

# What each process-group backend's codecs can do here (see the module docstring).
PRECISIONS_BY_DEVICE: dict[str, tuple[str, ...]] = {"cpu": ("fp32", "fp16"), "cuda": ("fp32", "fp16", "bf16", "fp8")}


@dataclass
class QCommsSettings:
    """Precision of the pooled-embedding all-to-all (and reduce-scatter) in each direction.

    Args:
        forward_precision: the embeddings sent forward: fp32 (off), fp16, bf16 or fp8 (GPUs).
        backward_precision: their gradients sent back: fp32 (off), fp16 or bf16 (GPUs).
        forward_loss_scale: for fp16, scale the values before quantizing (and back after), against
            underflow of small values; TorchRec's ``QCommsConfig.forward_loss_scale``.
        backward_loss_scale: the same for the gradients.
    """

    forward_precision: Precision = "fp32"
    backward_precision: Precision = "fp32"
    forward_loss_scale: float | None = None
    backward_loss_scale: float | None = None


def check_qcomms(settings: QCommsSettings | None, device_type: str) -> None:
    """Raises a ValueError naming the setting for a precision this device's backend cannot carry."""
    if settings is None:
        return
    allowed = PRECISIONS_BY_DEVICE.get(device_type, ("fp32",))
    for direction in ("forward", "backward"):
        precision = getattr(settings, f"{direction}_precision")
        if precision not in PRECISIONS_BY_DEVICE["cuda"]:
            raise ValueError(f"{SETTING}.{direction}_precision = {precision!r}: choose one of {', '.join(PRECISIONS_BY_DEVICE['cuda'])}")
        if precision not in allowed:
            raise ValueError(
                f"{SETTING}.{direction}_precision = {precision}: not available on {device_type} (gloo carries "
                f"{', '.join(allowed)}); use fp16, or run on GPUs"
            )
    if settings.backward_precision == "fp8":
        raise ValueError(f"{SETTING}.backward_precision = fp8: TorchRec quantizes gradients to fp16 or bf16 only; use bf16")
    for direction in ("forward", "backward"):
        scale = getattr(settings, f"{direction}_loss_scale")
        if scale is not None and not scale > 0:
            raise ValueError(f"{SETTING}.{direction}_loss_scale = {scale}: must be > 0")


def qcomms_config(settings: QCommsSettings) -> QCommsConfig:
    """TorchRec's config for the settings."""
    return QCommsConfig(
        forward_precision=CommType(settings.forward_precision),
        backward_precision=CommType(settings.backward_precision),
        forward_loss_scale=settings.forward_loss_scale,
        backward_loss_scale=settings.backward_loss_scale,
    )


def sharders_with_qcomms(settings: QCommsSettings | None, device: torch.device) -> list[ModuleSharder[nn.Module]]:
    """The sharders of app.distributed.sharding.default_sharders, with the codecs of ``settings`` (None or
    fp32 both ways: no codecs, the same sharders)."""
    registry = None if settings is None else get_qcomm_codecs_registry(qcomms_config(settings), device=device)
    if registry is None:
        return default_sharders()
    return [EmbeddingBagCollectionSharder(qcomm_codecs_registry=registry)]
