"""Which dense and replicated-table optimizers get torch's fused kernel, decided up front per device type
and torch version (app/compat.py's table), and that the optimizer built for CPU parameters is fused."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torchrec.optim import RowWiseAdagrad

from app.compat import fused_supported
from app.train.optimizers import build_optimizer, fastest_implementation

# Every supported torch as its version string reads: the ROCm image's nightly, the CUDA image's 2.11,
# the 2.12 releases, the pinned CPU build and the newest.
SUPPORTED_TORCH_VERSIONS = ["2.10.0.dev20251112+rocm7.1", "2.10.0", "2.11.0", "2.12.0", "2.12.1", "2.13.0+cpu", "2.14.1"]


@pytest.mark.parametrize("torch_version", SUPPORTED_TORCH_VERSIONS)
@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
@pytest.mark.parametrize("optimizer_class", [torch.optim.Adam, torch.optim.SGD])
def test_adam_and_sgd_are_fused_on_cpu_and_cuda_in_every_supported_torch(optimizer_class, device_type, torch_version):
    assert fused_supported(optimizer_class, device_type, torch_version) is True


@pytest.mark.parametrize("torch_version", SUPPORTED_TORCH_VERSIONS)
def test_adagrad_is_fused_on_cpu_in_every_supported_torch(torch_version):
    assert fused_supported(torch.optim.Adagrad, "cpu", torch_version) is True


@pytest.mark.parametrize(
    ("torch_version", "fused"),
    [
        # torch/optim/adagrad.py:135 of 2.10 and 2.11 refuses CUDA (ROCm too) at the first step().
        ("2.10.0.dev20251112+rocm7.1", False),
        ("2.10.0", False),
        ("2.11.0", False),
        ("2.11.0+cu130", False),
        # A 2.12 nightly may predate the change: counted as older than 2.12.0.
        ("2.12.0.dev20260301", False),
        ("2.12.0", True),
        ("2.12.0+cu130", True),
        ("2.12.1", True),
        ("2.13.0", True),
        ("2.14.1", True),
    ],
)
def test_adagrad_on_cuda_is_fused_from_torch_2_12(torch_version, fused):
    assert fused_supported(torch.optim.Adagrad, "cuda", torch_version) is fused


@pytest.mark.parametrize("torch_version", SUPPORTED_TORCH_VERSIONS)
@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_rowwise_adagrad_takes_no_fused_argument_and_is_never_fused(device_type, torch_version):
    assert fused_supported(RowWiseAdagrad, device_type, torch_version) is False


@pytest.mark.parametrize("device_type", ["mps", "xpu", "hpu", "meta"])
@pytest.mark.parametrize("optimizer_class", [torch.optim.Adagrad, torch.optim.Adam, torch.optim.SGD])
def test_other_device_types_keep_the_default_implementation(optimizer_class, device_type):
    assert fused_supported(optimizer_class, device_type, "2.13.0") is False


class _DenseAndTable(nn.Module):
    """Two dense parameters and one replicated table, named as in the app's DLRM."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.dense = nn.Linear(3, 2)
        self.sparse_arch = nn.Module()
        self.sparse_arch.table = nn.Parameter(torch.randn(4, 2))


def _fused_by_part(optimizer) -> dict[str, bool]:
    return {key: bool(part.param_groups[0].get("fused")) for key, part in optimizer.optimizers}


@pytest.mark.parametrize(
    ("dense_optimizer", "sparse_optimizer", "expected"),
    [
        ("adagrad", "adagrad", {"dense": True, "replicated_tables": True}),
        ("adam", "adam", {"dense": True, "replicated_tables": True}),
        ("sgd", "sgd", {"dense": True, "replicated_tables": True}),
        ("adam", "row_wise_adagrad", {"dense": True, "replicated_tables": False}),
    ],
)
def test_the_optimizer_built_for_cpu_parameters_is_fused_where_torch_has_the_kernel(
    dense_optimizer, sparse_optimizer, expected
):
    optimizer = build_optimizer(
        _DenseAndTable(),
        table_prefix="sparse_arch.",
        sparse_optimizer=sparse_optimizer,
        sparse_learning_rate=0.1,
        dense_optimizer=dense_optimizer,
        dense_learning_rate=0.1,
    )
    assert _fused_by_part(optimizer) == expected


@pytest.mark.parametrize("optimizer_class", [torch.optim.Adagrad, torch.optim.Adam, torch.optim.SGD])
def test_the_fused_update_on_cpu_equals_the_default_one(optimizer_class):
    torch.manual_seed(0)
    start, gradient = torch.randn(5, 3), torch.randn(5, 3)
    fused_param, default_param = nn.Parameter(start.clone()), nn.Parameter(start.clone())
    fused = fastest_implementation(optimizer_class, [fused_param], lr=0.1)
    default = optimizer_class([default_param], lr=0.1)
    for param, optimizer in ((fused_param, fused), (default_param, default)):
        param.grad = gradient.clone()
        optimizer.step()
    assert fused.param_groups[0]["fused"] is True
    torch.testing.assert_close(fused_param.detach(), default_param.detach())
    assert not torch.equal(fused_param.detach(), start)
