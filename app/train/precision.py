"""The default ``trainer.precision`` when a run leaves it unset: bf16 autocast where the CPU multiplies bf16 natively.

The dense part of a DLRM (bottom MLP, interaction, top MLP) is GEMMs; on a CPU with bf16 matrix units
(Intel AMX, or AVX512-BF16 dot-product instructions) oneDNN runs them in bf16 at about twice the float32
rate (docs/performance.md#bf16-autocast-on-cpu). ``bf16-mixed`` is Lightning's autocast: parameters, the
embedding tables, the optimizers' state and the click logit (``Float32Linear``) stay float32. On a CPU
without those units bf16 is emulated and slower, so float32 stays the default there. On GPUs the
default stays Lightning's own (``32-true``): not measured on one yet.

A precision the user sets (``--trainer.precision 32-true``) always wins.
"""

from __future__ import annotations

import torch

FLOAT32 = "32-true"
BF16_MIXED = "bf16-mixed"


def cpu_bf16_units() -> str | None:
    """The CPU's bf16 matrix units as named in ``/proc/cpuinfo`` flags (``amx_bf16``, ``avx512_bf16``), or None.

    torch's ``is_mkldnn_bf16_supported`` is not the test: it is also true on AVX-512 CPUs that only
    emulate bf16 (a float32 GEMM with conversions, slower than float32 alone).
    """
    probes = (("amx_bf16", "_is_amx_tile_supported"), ("avx512_bf16", "_is_avx512_bf16_supported"))
    for flag, probe in probes:
        supported = getattr(torch.cpu, probe, None)  # private cpuinfo probes of torch.cpu, in torch >= 2.3
        if supported is not None and supported():
            return flag
    return None


def default_precision(accelerator: object) -> tuple[str | None, str]:
    """The precision for a run whose ``trainer.precision`` is unset, on ``accelerator`` (a name such as
    ``cpu``/``gpu``/``auto``, or an Accelerator), and the reason, for the log.

    None leaves Lightning's default (``32-true``)."""
    if accelerator is None:
        accelerator = "auto"
    name = (accelerator if isinstance(accelerator, str) else type(accelerator).__name__).lower()
    on_cpu = "cpu" in name or (name == "auto" and not torch.cuda.is_available())
    if not on_cpu:
        return None, "not on CPU: Lightning's default 32-true"
    units = cpu_bf16_units()
    if units is None:
        return None, "this CPU has no bf16 matrix units (amx_bf16, avx512_bf16): float32"
    return BF16_MIXED, (
        f"this CPU multiplies bf16 natively ({units}): the dense layers run under bf16 autocast, "
        "tables, optimizer state and the click logit stay float32; --trainer.precision 32-true for float32"
    )


def check_precision_supported(precision: str, device_type: str, gpu_has_bf16: bool | None = None) -> None:
    """Raises a ValueError naming ``trainer.precision`` for bf16 on a GPU without bf16 support, where torch's
    autocast would fall back to float32 with a warning and the run would claim a precision it does not train in.

    ``gpu_has_bf16``: whether the GPU supports bf16 (default: ``torch.cuda.is_bf16_supported()`` of the current
    device, asked only on a CUDA run where CUDA is available). On CPU, bf16 is always allowed: emulated where the CPU lacks bf16 units."""
    if device_type != "cuda" or not precision.startswith("bf16"):
        return
    if gpu_has_bf16 is None:
        if not torch.cuda.is_available():
            return  # no GPU to ask: the run stops at its device set-up, with CUDA's own error
        gpu_has_bf16 = torch.cuda.is_bf16_supported()
    if not gpu_has_bf16:
        name = torch.cuda.get_device_name() if torch.cuda.is_available() else "this GPU"
        raise ValueError(
            f"trainer.precision = {precision}: {name} has no bf16 support (torch.cuda.is_bf16_supported() is False); "
            f"use {FLOAT32}"
        )
