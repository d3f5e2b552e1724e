"""Compiles a DLRM's dense layers with ``torch.compile`` (Inductor); the sparse part stays eager.

The dense layers are the bottom MLP, the interaction and the top MLP (and DCNv2's cross layers or the
projection's branches): every child of the DLRM except ``sparse_arch``. The sparse part (KeyedJaggedTensor,
the embedding all-to-alls and FBGEMM's fused lookup) is not compiled: TorchRec shards it into modules that
Dynamo would break its graph around, and FBGEMM's kernels are already fused.

Each dense child is compiled in place (``nn.Module.compile``), so that:

- its parameters and state-dict keys stay what they are: a checkpoint moves between compiled and eager
  runs unchanged;
- TorchRec's training pipeline, which traces the model with ``torch.fx`` to find the sharded modules,
  sees each dense child as one leaf call (TorchRec's tracer makes every child without a sharded module
  a leaf) and never traces into the compiled code.

What it gives (measured, docs/performance.md): on 2 CPU processes Inductor fuses each Linear's bias and
ReLU and their backward into one loop and cuts allocations: the dense forward/backward of the
torchrec_reference model takes about a quarter less time. On GPUs it also cuts kernel launches.

Example::

    model = build_dlrm(...)
    check_compile_supported("cpu")       # before any worker starts
    compile_dense_layers(model)          # ["dense_arch", "inter_arch", "over_arch"]
"""

from __future__ import annotations

import time

import torch
from torch import nn

# The one child of TorchRec's DLRM variants that holds the embedding tables.
SPARSE_CHILD = "sparse_arch"

SETTING = "model.compile"


def dense_layer_names(model: nn.Module) -> list[str]:
    """The children of a DLRM that ``compile_dense_layers`` compiles: all but the sparse part."""
    return [name for name, _ in model.named_children() if name != SPARSE_CHILD]


def compile_dense_layers(model: nn.Module) -> list[str]:
    """Compiles every dense child of ``model`` in place (compilation itself happens at its first call,
    once per mode: training, and evaluation under no_grad); returns their names.

    ``dynamic=None`` is torch's default: the first batch size compiles static, a second one (the last
    batch of an epoch, an evaluation batch size) compiles once more with the batch dimension dynamic,
    and every later size reuses that.
    """
    names = dense_layer_names(model)
    for name in names:
        model.get_submodule(name).compile()
    return names


def compiled_layer_names(model: nn.Module) -> list[str]:
    """The children of ``model`` compiled by ``compile_dense_layers`` (for tests and reports)."""
    return [name for name, child in model.named_children() if getattr(child, "_compiled_call_impl", None) is not None]


def check_compile_supported(device_type: str) -> None:
    """Raises a ValueError naming ``model.compile`` where torch.compile cannot build code here: a Python
    Dynamo does not support, no C++ compiler for Inductor's CPU code, no Triton for its GPU code.
    Decided before any worker starts: a failure at the first step would cost the whole launch."""
    from torch._dynamo.eval_frame import check_if_dynamo_supported

    try:
        check_if_dynamo_supported()
    except Exception as error:  # torch raises RuntimeError for an unsupported Python or platform
        raise ValueError(f"{SETTING} = true: torch.compile is not supported here ({error}); set {SETTING}: false") from None
    if device_type == "cpu":
        _check_cpp_compiler()
    elif device_type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            raise ValueError(
                f"{SETTING} = true: Inductor's GPU code needs Triton, which this torch {torch.__version__} cannot "
                f"import; install the triton build that matches torch, or set {SETTING}: false"
            )


def _check_cpp_compiler() -> None:
    # Inductor's own search (config.cpp.cxx, the CXX variable), so that the check asks what it will use.
    from torch._inductor import cpp_builder

    try:
        compiler = cpp_builder.get_cpp_compiler()
    except Exception as error:  # Inductor raises its own InvalidCxxCompiler
        raise ValueError(
            f"{SETTING} = true: Inductor compiles CPU code with a C++ compiler and found none ({error}); install "
            f"g++ (Debian: apt-get install g++), point CXX at one, or set {SETTING}: false"
        ) from None
    if not compiler:
        raise ValueError(f"{SETTING} = true: Inductor found no C++ compiler; install g++ or set {SETTING}: false")


class FirstStepTimer:
    """Times the first compiled training step, so that its wait (compilation, tens of seconds on a small
    CPU) is printed once and not taken for a hang."""

    def __init__(self) -> None:
        self._started_s: float | None = None
        self.reported = False

    def start(self) -> None:
        if self._started_s is None:
            self._started_s = time.perf_counter()

    def stop(self) -> float | None:
        """Seconds since ``start`` the first time it is called after it, else None."""
        if self.reported or self._started_s is None:
            return None
        self.reported = True
        return time.perf_counter() - self._started_s
