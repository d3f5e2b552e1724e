"""The notices a run used to print (silenced by ``app.notices.silence_library_notices``), and the
proof behind the one that sounds alarming.

Every table the plan replicates (``data_parallel``) made torch print, on every rank: "fbgemm::
dense_embedding_codegen_lookup_function: an autograd kernel was not registered to the Autograd key(s)
but we are trying to backprop through it. This may lead to silently incorrect behavior". It is
harmless here, and these tests show why:

- A replicated table is served by TorchRec's ``BatchedDenseEmbeddingBag``, which wraps fbgemm's
  ``DenseTableBatchedEmbeddingBagsCodegen``; its forward calls that op. fbgemm registers the op for
  the CPU (and CUDA) dispatch key only, so torch's autograd fallback runs first and, once the
  gradient reaches the op's output, warns. But the CPU kernel itself returns
  ``SplitLookupFunction_Dense_Op::apply(...)``: a C++ ``torch::autograd::Function`` whose backward
  is fbgemm's ``split_embedding_backward_codegen_dense_cpu``. The output already carries that node
  as its ``grad_fn``, so the fallback only adds a warning hook; the gradient is fbgemm's own.
  (Were it not, the fallback would have set a ``WarnNotImplemented`` node that returns no gradient,
  and the table would never train.) TorchRec then wraps each replicated lookup in a DDP of its own
  (embeddingbag.py, ``init_data_parallel``), whose all-reduce averages that gradient over the ranks.
- ``test_dense_lookup_gradient_is_fbgemms_own_and_exact``: that op, built the way TorchRec builds it,
  has that ``grad_fn``, warns, and gives exactly ``nn.EmbeddingBag``'s output and gradient.
- ``test_replicated_tables_train_like_one_process``: the app's own path (TorchRecStrategy, DMP,
  every table ``data_parallel``, DDP's all-reduce, 2 gloo processes) trains the tables and the MLPs
  to the same values, step losses included, as one process with every table unreplicated
  (``table_wise``: fbgemm's fused kernel, an independent implementation of the same gradient). Both
  use plain SGD, whose update is the gradient itself: the existing sharded == unsharded check
  (tests/distributed/test_sharding.py, ``[data_parallel]``) trains the tables with row-wise Adagrad, which
  divides by the gradient's own size and so would not see a gradient off by a constant factor.

``test_a_fit_with_replicated_tables_prints_none_of_the_silenced_notices`` runs ``python -m app fit``
as a user does (Lightning starts the second rank as another ``python -m app``) and checks that none
of the silenced notices is printed, so that a library upgrade changing one of them shows up here.
(A fit reads no checkpoint: the ShardedTensor deprecation that validate, test, predict and resume
printed is checked on a real ShardedTensor in ``test_replicated_tables_train_like_one_process``.)
"""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import torch
from fbgemm_gpu.split_embedding_configs import SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import DenseTableBatchedEmbeddingBagsCodegen
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed.batched_embedding_kernel import BatchedDenseEmbeddingBag
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

from tests.embedding_init import reference_tables
from tests.multiprocess import run_on_ranks
from tests.checkpoint.test_checkpoint_runs import app_env
from tests.checkpoint.test_checkpoint_runs import fit_args as tiny_fit_args
from tests.distributed.test_sharding import NUM_TABLES, fit_args

FBGEMM_NOTICE = "fbgemm::dense_embedding_codegen_lookup_function: an autograd kernel was not registered"

# What each silenced notice prints (a part of it); the fit below must print none of them.
SILENCED = {
    "fbgemm autograd fallback": FBGEMM_NOTICE,
    "Lightning's logger advertisement": "Tip: For seamless cloud",
    "Lightning's dataloader_iter notice": "Found `dataloader_iter` argument",
    "Lightning's all_gather deprecation": "torch.distributed.nn.functional.all_gather is deprecated",
    "ShardedTensor deprecation": "deprecating ShardedTensor",
    "planner: data_parallel has no spec": "Sharding spec not found for",
    "data_parallel ignores cache params": "caching params will be ignored",
    "DDP broadcast_buffers": "`broadcast_buffers` is deprecated",
    "pytree LeafSpec": "LeafSpec",
    "fx tracing": "is_fx_tracing",
    "transfer_batch_to_device is the module's": "overridden `transfer_batch_to_device` in `LightningModule`",
}


def _dyadic(generator: torch.Generator, *shape: int) -> torch.Tensor:
    """Multiples of 1/8 in [-1, 1]: sums of a few of them are exact in float32 in any order, so the
    comparisons below can be exact whatever order each implementation adds in."""
    return torch.randint(-8, 9, shape, generator=generator).float() / 8


def test_dense_lookup_gradient_is_fbgemms_own_and_exact():
    generator = torch.Generator().manual_seed(0)
    rows, dim, batch_size = [50, 7, 300], 8, 64
    # As torchrec/distributed/batched_embedding_kernel.py (BatchedDenseEmbeddingBag) builds it on CPU.
    lookup = DenseTableBatchedEmbeddingBagsCodegen(
        [(r, dim) for r in rows],
        feature_table_map=list(range(len(rows))),
        pooling_mode=PoolingMode.SUM,
        use_cpu=True,
        weights_precision=SparseType.FP32,
        output_dtype=SparseType.FP32,
    )
    tables = [_dyadic(generator, r, dim) for r in rows]
    with torch.no_grad():
        for weights, table in zip(lookup.split_embedding_weights(), tables):
            weights.copy_(table)
    # Bags of 0 to 4 ids per row (empty bags and repeated ids included), feature-major as in a KJT.
    lengths = [torch.randint(0, 5, (batch_size,), generator=generator) for _ in rows]
    ids = [torch.randint(0, r, (int(n.sum()),), generator=generator) for r, n in zip(rows, lengths)]
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(torch.cat(lengths), 0)])

    pooled = lookup(torch.cat(ids), offsets)
    # The gradient comes from fbgemm's own autograd Function, not from the fallback's WarnNotImplemented.
    assert "SplitLookupFunction_Dense_Op" in pooled.grad_fn.name()
    upstream = _dyadic(generator, *pooled.shape)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pooled.backward(upstream)
    assert any(FBGEMM_NOTICE in str(w.message) for w in caught), (
        "this op no longer warns on this stack: its filter in app/notices.py can go"
    )

    gradients = torch.split(lookup.weights.grad, [r * dim for r in rows])
    for feature, (r, table, n, feature_ids) in enumerate(zip(rows, tables, lengths, ids)):
        columns = slice(feature * dim, (feature + 1) * dim)
        bag = nn.EmbeddingBag(r, dim, mode="sum")
        with torch.no_grad():
            bag.weight.copy_(table)
        expected = bag(feature_ids, torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(n, 0)[:-1]]))
        expected.backward(upstream[:, columns])
        # By hand: each id's row receives the upstream gradient of every bag it is in, once per occurrence.
        bag_of_each_id = torch.repeat_interleave(torch.arange(batch_size), n)
        by_hand = torch.zeros(r, dim).index_add_(0, feature_ids, upstream[bag_of_each_id, columns])

        gradient = gradients[feature].view(r, dim)
        torch.testing.assert_close(pooled[:, columns], expected, rtol=0, atol=0)
        torch.testing.assert_close(gradient, bag.weight.grad, rtol=0, atol=0)
        torch.testing.assert_close(gradient, by_hand, rtol=0, atol=0)
        assert (gradient != 0).any(dim=1).sum() >= min(r, 5), feature  # not vacuous: many rows get one


MAX_STEPS = 6
SPARSE_LEARNING_RATE = 2.0
# Float rounding of two implementations adding in different orders (measured here: below 2e-8).
TOLERANCE = 2e-7


def trained_weights(cli) -> dict:
    """Every table in full, the other parameters, the starting tables, the kernels that served the
    replicated tables, and the training probe's steps; on a ShardedTensor, whether the app's filters
    catch torch's ShardedTensor deprecation (raised for real when its shape is read)."""
    module = cli.trainer.lightning_module
    state_dict = module.state_dict()
    tables, others, sharded_tensor_notices = {}, {}, None
    for key, value in state_dict.items():
        if ".embedding_bags." not in key:
            others[key] = value.detach().clone()
        elif isinstance(value, ShardedTensor):  # table_wise on one process: all shards are here
            tables[key] = torch.zeros(value.metadata().size)
            value.gather(dst=0, out=tables[key])
            if sharded_tensor_notices is None:
                sharded_tensor_notices = _notices_when_reading_shape(value)
        else:  # data_parallel: the full replica
            tables[key] = value.detach().clone()
    dense_kernels = []  # (the lookup's wrapper, the kernel's fbgemm module, its tables)
    for collection in module.modules():
        if isinstance(collection, ShardedEmbeddingBagCollection):
            for lookup in collection._lookups:  # a plain list: not in modules()
                inner = lookup.module if isinstance(lookup, DistributedDataParallel) else lookup
                dense_kernels.extend(
                    (type(lookup).__name__, type(k.emb_module).__name__, [t.name for t in k.config.embedding_tables])
                    for k in inner._emb_modules
                    if isinstance(k, BatchedDenseEmbeddingBag)
                )
    (probe,) = [c for c in cli.trainer.callbacks if type(c).__name__ == "TrainingProbe"]
    return {
        "tables": tables,
        "start": reference_tables(state_dict),
        "others": others,
        "dense_kernels": dense_kernels,
        "steps": probe.steps,
        "sharded_tensor_notices": sharded_tensor_notices,
    }


def _notices_when_reading_shape(value: ShardedTensor) -> dict[str, int]:
    from app.notices import silence_library_notices

    counts = {}
    for label, silenced in (("unfiltered", False), ("app filters", True)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if silenced:
                silence_library_notices()
            _ = value.shape
        counts[label] = sum("deprecating ShardedTensor" in str(w.message) for w in caught)
    return counts


def sgd_fit_args(sample, root: Path, sharding_type: str, batch_size_per_rank: int) -> list[str]:
    return fit_args(sample, root, sharding_type, batch_size_per_rank) + [
        # Plain SGD for the tables too: the update is then the gradient, scale included.
        "--model.sparse_optimizer", "sgd",
        "--model.sparse_learning_rate", str(SPARSE_LEARNING_RATE),
        "--trainer.max_epochs", "1",
        "--trainer.max_steps", str(MAX_STEPS),
        "--trainer.limit_val_batches", "0",
        "--trainer.callbacks+=tests.training_probe.TrainingProbe",
    ]  # fmt: skip


def test_replicated_tables_train_like_one_process(sample, tmp_path):
    (one,) = run_on_ranks(1, sgd_fit_args(sample, tmp_path / "one", "table_wise", 128), tmp_path, trained_weights)
    two = run_on_ranks(2, sgd_fit_args(sample, tmp_path / "two", "data_parallel", 64), tmp_path, trained_weights)

    # Every table was replicated, and served by the kernel whose op warns (the test above).
    # (TorchRec wraps a replicated lookup in DDP of its own, embeddingbag.py init_data_parallel: that
    # all-reduce averages the tables' gradients over the ranks.)
    for rank in two:
        assert [kernel[:2] for kernel in rank["dense_kernels"]] == [
            ("DistributedDataParallel", "DenseTableBatchedEmbeddingBagsCodegen")
        ]
        assert len(rank["dense_kernels"][0][2]) == NUM_TABLES
    assert one["dense_kernels"] == []
    # The same global batches, step by step: one process's batch is the two ranks' batches together.
    assert len(one["steps"]) == len(two[0]["steps"]) == len(two[1]["steps"]) == MAX_STEPS
    for step, (single, *pair) in enumerate(zip(one["steps"], two[0]["steps"], two[1]["steps"])):
        assert sorted(single[3]) == sorted(pair[0][3] + pair[1][3]), step
        # Each rank's loss is the mean over its half of the rows: their mean is the global mean.
        torch.testing.assert_close((pair[0][2] + pair[1][2]) / 2, single[2], rtol=0, atol=3e-7)

    for key, table in one["tables"].items():
        torch.testing.assert_close(one["start"][key], two[0]["start"][key], rtol=0, atol=0)
        # Training moved every table (here by 1e-3 to 2e-2), thousands of times the tolerance below.
        assert (table - one["start"][key]).abs().max() > 5e-4, key
        for rank in two:
            torch.testing.assert_close(rank["tables"][key], table, rtol=0, atol=TOLERANCE, msg=lambda m: f"{key}: {m}")
    for key, value in one["others"].items():  # the MLPs
        for rank in two:
            torch.testing.assert_close(rank["others"][key], value, rtol=0, atol=TOLERANCE, msg=lambda m: f"{key}: {m}")

    # The ShardedTensor deprecation is real (one process held its tables as ShardedTensor), and silenced.
    assert one["sharded_tensor_notices"] == {"unfiltered": 1, "app filters": 0}


def test_a_fit_with_replicated_tables_prints_none_of_the_silenced_notices(sample, tmp_path):
    env = {k: v for k, v in app_env().items() if k != "PYTHONWARNINGS"}
    args = [
        *tiny_fit_args(sample, tmp_path),  # later settings win
        "--trainer.strategy.sharding_types", "[data_parallel]",
        "--trainer.max_steps", "3", "--trainer.limit_val_batches", "2", "--trainer.val_check_interval", "2",
        "--rank_health.every_n_steps", "1",  # its all-gather is Lightning's deprecated one
    ]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "app", *args], capture_output=True, text=True, timeout=300, env=env,
        cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-5000:]
    # It did what prints them: 2 ranks, replicated tables, pipelined steps, a validation.
    assert "TorchRec sharding plan (2 ranks)" in output and "data_parallel" in output
    assert (tmp_path / "checkpoints" / "last.ckpt").exists()
    printed = sorted(name for name, text in SILENCED.items() if text in output)
    assert printed == [], f"printed {printed}:\n{output[-5000:]}"
