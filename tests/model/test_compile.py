"""model.compile: which layers are compiled, what stays as it was, and the settings refused before launch.

The compiled path's training runs (same losses as eager through the pipeline and the plain loop, and
checkpoints across the two) are in tests/train/test_pipeline.py, beside the eager runs they compare with.
"""

from __future__ import annotations

import pytest
import torch
import torch._inductor.config

from app.model.compile import (
    check_compile_mode,
    check_compile_supported,
    compile_dense_layers,
    compile_modes,
    compiled_layer_names,
    records_cuda_graphs,
)
from app.model.dlrm import build_dlrm
from tests.cli.test_cli import test_bad_settings_stop_before_any_worker_with_one_line as refused_before_launch

SMALL = dict(embedding_dim=8, num_embeddings_per_feature=[10] * 26, dense_arch_layer_sizes=[16, 8],
             over_arch_layer_sizes=[16, 1], dcn_num_layers=2, dcn_low_rank_dim=4,
             interaction_branch1_layer_sizes=[16, 8], interaction_branch2_layer_sizes=[16, 8])  # fmt: skip

# Every TorchRec DLRM variant (and DLRMConcat) names its parts alike; DCNv2's cross layers and the
# projection's branches are its inter_arch.
DENSE_LAYERS = ["dense_arch", "inter_arch", "over_arch"]


@pytest.mark.parametrize("interaction", ["dot", "cat", "dcn", "projection"])
def test_every_dense_layer_is_compiled_and_the_tables_and_state_dict_keys_are_not_touched(interaction):
    torch.manual_seed(0)
    eager = build_dlrm(interaction=interaction, embedding_device="meta", **SMALL)
    torch.manual_seed(0)
    compiled = build_dlrm(interaction=interaction, embedding_device="meta", **SMALL)
    assert compile_dense_layers(compiled, "cuda") == DENSE_LAYERS
    assert compiled_layer_names(compiled) == DENSE_LAYERS
    assert compiled_layer_names(eager) == []
    assert type(compiled.dense_arch) is type(eager.dense_arch)  # compiled in place, not wrapped
    # The same keys and values: checkpoints move between compiled and eager runs.
    eager_state, compiled_state = eager.state_dict(), compiled.state_dict()
    assert list(compiled_state) == list(eager_state)
    for key, value in eager_state.items():
        if not value.is_meta:
            assert torch.equal(compiled_state[key], value), key


def test_without_a_cpp_compiler_compile_is_refused_naming_the_setting():
    with torch._inductor.config.patch({"cpp.cxx": (None, "/no/such/g++")}):
        with pytest.raises(ValueError, match="model.compile = true: Inductor compiles CPU code with a C.. compiler and found none"):
            check_compile_supported("cpu")
    check_compile_supported("cpu")  # g++ is here: accepted


def test_on_gpus_without_triton_compile_is_refused_naming_the_setting():
    from torch.utils._triton import has_triton

    if has_triton():
        pytest.skip("this torch imports Triton: nothing to refuse")
    with pytest.raises(ValueError, match="model.compile = true: Inductor's GPU code needs Triton"):
        check_compile_supported("cuda")


def test_dynamo_traces_every_compiled_dense_layer_instead_of_skipping_it(monkeypatch):
    # Dynamo skips the frame of a module that is a torch builtin (a bare nn.Sequential compiled with
    # nn.Module.compile runs eagerly); TorchRec's dense modules are not builtins and must each give a graph.
    # What Dynamo traces is the question here, not Inductor's code: its "eager" backend runs the traced
    # graphs as they are (Inductor's first C++ build takes most of a minute on a fresh cache).
    from torch._dynamo.utils import counters

    real_compile = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda module, mode: real_compile(module, backend="eager"))
    torch._dynamo.reset()
    counters.clear()
    model = build_dlrm(interaction="dot", embedding_device="meta", **SMALL)
    compile_dense_layers(model, "cpu")
    dense = model.dense_arch(torch.randn(4, 13))
    model.over_arch(model.inter_arch(dense, torch.randn(4, 26, 8))).sum().backward()
    assert counters["stats"]["unique_graphs"] >= len(DENSE_LAYERS)


def test_the_compile_mode_reaches_torch_compile_for_every_dense_layer(monkeypatch):
    modes = []
    real_compile = torch.nn.Module.compile

    def recording_compile(module, *args, **kwargs):
        modes.append(kwargs.get("mode"))
        return real_compile(module, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "compile", recording_compile)
    model = build_dlrm(interaction="dcn", embedding_device="meta", **SMALL)
    assert compile_dense_layers(model, "cuda", "reduce-overhead") == DENSE_LAYERS
    assert modes == ["reduce-overhead"] * 3
    assert compiled_layer_names(model) == DENSE_LAYERS


@pytest.mark.parametrize(
    ("mode", "cuda_graphs"),
    [("default", False), ("reduce-overhead", True), ("max-autotune", True), ("max-autotune-no-cudagraphs", False)],
)
def test_the_modes_that_replay_cuda_graphs_are_refused_off_a_gpu(mode, cuda_graphs):
    assert mode in compile_modes()
    assert records_cuda_graphs(mode) is cuda_graphs
    check_compile_mode(mode, compile=True)
    if cuda_graphs:
        with pytest.raises(ValueError, match=f"model.compile_mode = {mode} replays the dense layers as CUDA graphs, which need a CUDA GPU"):
            check_compile_supported("cpu", mode)
    else:
        check_compile_supported("cpu", mode)


def test_a_compile_mode_torch_lacks_or_set_without_compile_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"model.compile_mode = 'fast' is not a torch.compile mode of torch .*: default, "):
        check_compile_mode("fast", compile=True)
    with pytest.raises(ValueError, match="model.compile_mode = reduce-overhead applies to compiled dense layers: set model.compile: true"):
        check_compile_mode("reduce-overhead", compile=False)
    check_compile_mode("default", compile=False)


def test_the_cli_refuses_compile_without_a_cpp_compiler_before_any_worker(sample_dir, capsys):
    with torch._inductor.config.patch({"cpp.cxx": (None, "/no/such/g++")}):
        refused_before_launch(["--model.compile", "true"], "model.compile = true: Inductor compiles CPU code", sample_dir, capsys)


def test_the_pairwise_dot_interaction_gives_torchrecs_outputs_and_gradients_in_its_order():
    from torchrec.models.dlrm import InteractionArch

    from app.model.compile import PairwiseDotInteraction

    generator = torch.Generator().manual_seed(0)
    dense = torch.randn(5, 8, generator=generator, dtype=torch.float64)
    sparse = torch.randn(5, 4, 8, generator=generator, dtype=torch.float64)
    outputs, gradients = [], []
    for arch in (InteractionArch(num_sparse_features=4), PairwiseDotInteraction(num_sparse_features=4)):
        inputs = (dense.clone().requires_grad_(), sparse.clone().requires_grad_())
        out = arch(*inputs)
        (out * torch.arange(out.numel(), dtype=out.dtype).reshape(out.shape)).sum().backward()
        outputs.append(out)
        gradients.append([t.grad for t in inputs])
    assert outputs[0].shape == (5, 8 + 4 * 5 // 2)
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-12, atol=1e-12)
    for pairwise, torchrec in zip(gradients[1], gradients[0]):
        torch.testing.assert_close(pairwise, torchrec, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("interaction", "device_type", "pairwise"), [
    ("dot", "cpu", True), ("dot", "cuda", False), ("cat", "cpu", False), ("dcn", "cpu", False), ("projection", "cpu", False),
])  # fmt: skip
def test_on_cpu_the_compiled_dot_interaction_takes_the_pairwise_form(interaction, device_type, pairwise):
    from app.model.compile import PairwiseDotInteraction

    model = build_dlrm(interaction=interaction, embedding_device="meta", **SMALL)
    keys = list(model.state_dict())
    compile_dense_layers(model, device_type)
    assert isinstance(model.inter_arch, PairwiseDotInteraction) == pairwise
    assert list(model.state_dict()) == keys
