"""Whether this machine can run the GPU suite, decided once: a GPU torch can use and an fbgemm_gpu
with GPU kernels; and a skip mark for the checks that need more than one GPU."""

from __future__ import annotations

import functools
import importlib.metadata

import pytest

# An op of FBGEMM's sparse library that every fbgemm_gpu build since 0.4 has, with a CUDA kernel in
# the GPU builds (sparse_ops_gpu.cpp registers it for the CUDA dispatch key, which HIP builds use too)
# and none in the CPU build (fbgemm-gpu-cpu). Asked of the dispatcher, so no kernel runs.
_FBGEMM_PROBE_OP = "fbgemm::asynchronous_complete_cumsum"


@functools.cache
def no_gpu_reason() -> str | None:
    """Why the GPU checks cannot run here, or None when they can."""
    import torch

    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else f"ROCm/HIP {torch.version.hip}" if torch.version.hip else "CPU only"
        return f"no GPU: torch.cuda.is_available() is False (torch {torch.__version__}, built for {build})"
    try:
        import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
    except Exception as error:  # an ABI mismatch with torch shows up as an OSError or an ImportError
        return f"fbgemm_gpu does not import: {type(error).__name__}: {error}"
    try:
        has_gpu_kernel = torch._C._dispatch_has_kernel_for_dispatch_key(_FBGEMM_PROBE_OP, "CUDA")
    except RuntimeError as error:
        return f"fbgemm_gpu has no {_FBGEMM_PROBE_OP}: {error}"
    if not has_gpu_kernel:
        return f"fbgemm_gpu {library_version('fbgemm-gpu') or library_version('fbgemm-gpu-cpu')} has no GPU kernels (a CPU build): install its CUDA or ROCm build"
    return None


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if no_gpu_reason() is None else 0


def needs_gpus(count: int):
    """A skip mark for a test that needs ``count`` GPUs, with the reason, decided at collection."""
    return pytest.mark.skipif(
        no_gpu_reason() is None and gpu_count() < count, reason=f"needs {count} GPUs; this machine has {gpu_count()}"
    )


def library_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None
