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

What it gives (measured, docs/performance.md): alone on one CPU core, the dense forward/backward with
the optimizer step of the torchrec_reference model (B=512) took 43.2 ms eager, 40.8 ms compiled and
38.5 ms compiled with the pairwise dot interaction (medians of 10 alternating rounds): Inductor fuses
each Linear's bias and ReLU and their backward and cuts allocations. Inside DDP and the 2-process
benchmark that gain did not show (``model.compile`` is off by default). On GPUs it also cuts kernel
launches; not measured there.

Example::

    model = build_dlrm(...)
    check_compile_supported("cpu")       # before any worker starts
    compile_dense_layers(model, "cpu")   # ["dense_arch", "inter_arch", "over_arch"]
"""

from __future__ import annotations

import time

import torch
from torch import nn
from torchrec.models.dlrm import InteractionArch

# The one child of TorchRec's DLRM variants that holds the embedding tables.
SPARSE_CHILD = "sparse_arch"

SETTING = "model.compile"
MODE_SETTING = "model.compile_mode"
DEFAULT_MODE = "default"


def dense_layer_names(model: nn.Module) -> list[str]:
    """The children of a DLRM that ``compile_dense_layers`` compiles: all but the sparse part."""
    return [name for name, _ in model.named_children() if name != SPARSE_CHILD]


class PairwiseDotInteraction(InteractionArch):
    """TorchRec's dot interaction, the same outputs in the same order, computed as one product-and-sum per
    pair of features instead of a batched matrix product.

    TorchRec's ``InteractionArch`` computes every sample's whole (F+1) x (F+1) Gram matrix with ``bmm``
    and keeps its upper triangle. On CPU, a batch of 27 x 64 matrices runs at a fraction of the core's
    peak (MKL's batched GEMM on tiny matrices), and backward takes two more ``bmm``. Compiled, this form
    becomes one loop that reads each sample's embeddings once and computes only the pairs kept (and a
    fused loop for backward): measured 6.0 vs 9.4 ms forward+backward at B=512, F=26, D=64 on one core.
    Eager it is slow (it materialises the pairs): it is used only where the dense layers are compiled
    on CPU. No parameters and a non-persistent buffer: the state dict is TorchRec's.
    """

    def forward(self, dense_features: torch.Tensor, sparse_features: torch.Tensor) -> torch.Tensor:
        if self.F <= 0:
            return dense_features
        combined = torch.cat((dense_features.unsqueeze(1), sparse_features), dim=1)  # (B, F + 1, D)
        first, second = self.triu_indices  # TorchRec's pair order: its top MLP's inputs stay in place
        pairs = (combined[:, first, :] * combined[:, second, :]).sum(dim=-1)
        return torch.cat((dense_features, pairs), dim=1)


def use_pairwise_dot_interaction(model: nn.Module) -> bool:
    """Replaces a TorchRec dot interaction (exactly that class) by ``PairwiseDotInteraction``; True if it did."""
    if type(getattr(model, "inter_arch", None)) is not InteractionArch:
        return False
    model.inter_arch = PairwiseDotInteraction(num_sparse_features=model.inter_arch.F)
    return True


def compile_modes() -> list[str]:
    """``torch.compile``'s modes in this torch (``default``, ``reduce-overhead``, ``max-autotune``, ...)."""
    from torch._inductor import list_mode_options

    return list(list_mode_options())


def records_cuda_graphs(mode: str) -> bool:
    """Whether ``mode`` replays the compiled code as CUDA graphs (``reduce-overhead``, ``max-autotune``)."""
    from torch._inductor import list_mode_options

    return bool(list_mode_options(mode).get("triton.cudagraphs", False))


def check_compile_mode(mode: str, compile: bool) -> None:
    """Raises a ValueError naming ``model.compile_mode`` for a mode torch does not have, or one set without
    ``model.compile`` (it would silently change nothing). The device is checked by ``check_compile_supported``."""
    modes = compile_modes()
    if mode not in modes:
        raise ValueError(f"{MODE_SETTING} = {mode!r} is not a torch.compile mode of torch {torch.__version__}: {', '.join(modes)}")
    if mode != DEFAULT_MODE and not compile:
        raise ValueError(f"{MODE_SETTING} = {mode} applies to compiled dense layers: set {SETTING}: true, or leave {MODE_SETTING} unset")


def mark_cuda_graph_step() -> None:
    """Starts a new step of the CUDA graphs of dense layers compiled with a ``records_cuda_graphs`` mode.

    The dense layers are three compiled children called one after the other in a step (bottom MLP,
    interaction, top MLP; the sparse part runs eagerly between them). Left to its heuristic, torch's
    CUDA-graph trees start a new step at every compiled call that has no backward pending: in evaluation
    (no backward) the interaction's call would free the bottom MLP's outputs it reads. Once this is called,
    torch starts steps only here (``torch.compiler.cudagraph_mark_step_begin``): the LightningModule's forward
    calls it, once per training or evaluation step, so the three graphs of a step share one step.
    """
    torch.compiler.cudagraph_mark_step_begin()


def compile_dense_layers(model: nn.Module, device_type: str, mode: str = DEFAULT_MODE) -> list[str]:
    """Compiles every dense child of ``model`` in place (compilation itself happens at its first call,
    once per mode: training, and evaluation under no_grad); returns their names. On CPU the dot
    interaction takes the pairwise form first (``PairwiseDotInteraction``); on GPUs it stays TorchRec's
    (cuBLAS's batched GEMM; the pairwise form has not been measured on a GPU).

    ``dynamic=None`` is torch's default: the first batch size compiles static, a second one (the last
    batch of an epoch, an evaluation batch size) compiles once more with the batch dimension dynamic,
    and every later size reuses that.
    """
    if device_type == "cpu":
        use_pairwise_dot_interaction(model)
    # TorchRec's DMP wraps the dense layers in DDP. Dynamo then splits each compiled graph at DDP's bucket
    # boundaries (its DDPOptimizer, made for compiling the DDP module whole, to overlap the all-reduce):
    # each child here is its own graph already, and the split graphs measured slower (4 graphs, not 3).
    torch._dynamo.config.optimize_ddp = False
    names = dense_layer_names(model)
    for name in names:
        model.get_submodule(name).compile(mode=mode)
    return names


def compiled_layer_names(model: nn.Module) -> list[str]:
    """The children of ``model`` compiled by ``compile_dense_layers`` (for tests and reports)."""
    return [name for name, child in model.named_children() if getattr(child, "_compiled_call_impl", None) is not None]


def check_compile_supported(device_type: str, mode: str = DEFAULT_MODE) -> None:
    """Raises a ValueError naming ``model.compile`` where torch.compile cannot build code here: a Python
    Dynamo does not support, no C++ compiler for Inductor's CPU code, no Triton for its GPU code; and
    naming ``model.compile_mode`` for CUDA graphs off a CUDA GPU.
    Decided before any worker starts: a failure at the first step would cost the whole launch."""
    from torch._dynamo.eval_frame import check_if_dynamo_supported

    if device_type != "cuda" and records_cuda_graphs(mode):
        raise ValueError(
            f"{MODE_SETTING} = {mode} replays the dense layers as CUDA graphs, which need a CUDA GPU (here: "
            f"{device_type}); use {DEFAULT_MODE} or max-autotune-no-cudagraphs"
        )

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
