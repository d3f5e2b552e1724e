"""Weight decay (model.sparse_weight_decay, model.dense_weight_decay and their modes).

The sparse decay reaches FBGEMM's fused embedding kernel after DMP sharding; FBGEMM's CPU kernel drops
it (observed here, hence refused on CPU) and its GPU kernels move the looked-up rows by the amount
worked out by hand (tests/gpu/test_gpu_weight_decay.py, with ``by_hand`` below). The dense decay
changes torch's step by the amount worked out by hand. Settings a kernel does not apply are refused
by name before training.
"""

from __future__ import annotations

import math
import pickle

import pytest
import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    SplitTableBatchedEmbeddingBagsCodegen,
    WeightDecayMode,
)
from torch import nn
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.distributed.utils import optimizer_type_to_emb_opt_type
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from app.distributed.sharding import default_sharders
from app.model.dlrm import build_embedding_bag_collection
from app.train.module import DLRMModule
from app.train.optimizers import build_optimizer, check_weight_decay, fuse_sparse_optimizer
from tests.multiprocess import rendezvous_port, start_cli_ranks
from tests.cli.test_cli import test_bad_settings_stop_before_any_worker_with_one_line as refused_before_launch
from tests.train.test_lr_schedule import fbgemm_kernels
from tests.distributed.test_sharding import fit_args

LEARNING_RATE, WEIGHT_DECAY = 0.5, 0.1
# One table of 4 rows x 4; a batch of two bags, [row 1] and [row 2]; rows 0 and 3 are not looked up.
START = [[7.0, 7.0, 7.0, 7.0], [1.0, 1.0, 1.0, 1.0], [2.0, -2.0, 0.0, 0.0], [-7.0, 7.0, -7.0, 7.0]]
# The loss is sum(pooled * UPSTREAM): the gradient of row 1 is UPSTREAM[0], of row 2 UPSTREAM[1].
UPSTREAM = [[0.9, 0.9, -0.1, -0.1], [0.8, 0.2, 0.0, 0.0]]


def by_hand(optimizer: str, mode: str | None) -> list[list[float]]:
    """The table after one step of FBGEMM's ``optimizer`` (lr 0.5, decay 0.1) from fresh state; rows 0 and 3
    keep their values whatever the mode. FBGEMM's eps of 1e-8 is below float32's reach here.

    Row-wise Adagrad, no decay: accumulator = mean(g^2) = 0.41 (row 1), 0.17 (row 2); w -= lr * g / sqrt(acc).
    l2: g' = g + decay * w = [1, 1, 0, 0] (row 1, mean(g'^2) = 0.5) and [1, 0, 0, 0] (row 2, mean 0.25,
    lr / sqrt = 1); w -= lr * g' / sqrt(mean(g'^2)).
    decoupled: the accumulator of no decay, w = (1 - lr * decay) * w - lr * g / sqrt(acc), 1 - lr * decay = 0.95.
    Adam (decoupled, its only mode), first step: m / sqrt(v) = sign(g) after bias correction (0 where g is 0),
    w -= lr * (sign(g) + decay * w).
    """
    lr, decay = LEARNING_RATE, WEIGHT_DECAY
    if optimizer == "adam":
        row1 = [1.0 - lr * (1.0 + decay), 1.0 - lr * (1.0 + decay), 1.0 - lr * (-1.0 + decay), 1.0 - lr * (-1.0 + decay)]
        return [START[0], row1, [2.0 - lr * (1.0 + 2 * decay), -2.0 - lr * (1.0 - 2 * decay), 0.0, 0.0], START[3]]
    if mode == "l2":
        step = lr / math.sqrt(0.5)
        return [START[0], [1.0 - step, 1.0 - step, 1.0, 1.0], [2.0 - 1.0, -2.0, 0.0, 0.0], START[3]]
    keep = 1.0 - lr * decay if mode == "decoupled" else 1.0
    row1 = [keep * 1.0 - lr * g / math.sqrt(0.41) for g in UPSTREAM[0]]
    row2 = [keep * w - lr * g / math.sqrt(0.17) for w, g in zip(START[2], UPSTREAM[1])]
    return [START[0], row1, row2, START[3]]


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class _Tables(nn.Module):
    """A parent for the table collection: DMP shards submodules by their path in the plan."""

    def __init__(self, tables: nn.Module) -> None:
        super().__init__()
        self.tables = tables

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        return self.tables(features).values()


def sharded_table(
    optimizer: str, weight_decay: float, mode: str, device: torch.device
) -> tuple[DistributedModelParallel, SplitTableBatchedEmbeddingBagsCodegen]:
    """The app's table t_cat_0 (4 x 4), its optimizer fused as the app fuses it, sharded table-wise by DMP
    on this one-rank process group."""
    tables = build_embedding_bag_collection(4, [4], "meta")
    fuse_sparse_optimizer(tables.parameters(), optimizer, LEARNING_RATE, weight_decay, mode)
    module_plan = construct_module_sharding_plan(
        tables, per_param_sharding={"t_cat_0": table_wise(rank=0)}, local_size=1, world_size=1,
        device_type=device.type, sharder=default_sharders()[0],
    )  # fmt: skip
    model = DistributedModelParallel(
        _Tables(tables), env=ShardingEnv.from_process_group(dist.group.WORLD), device=device,
        plan=ShardingPlan({"tables": module_plan}), sharders=default_sharders(),
    )  # fmt: skip
    (kernel,) = fbgemm_kernels(model.fused_optimizer)
    return model, kernel


def train_one_step(model: DistributedModelParallel, kernel: SplitTableBatchedEmbeddingBagsCodegen) -> list[list[float]]:
    """Sets the table to START, runs one batch whose loss is sum(pooled * UPSTREAM), returns the table."""
    (weights,) = kernel.split_embedding_weights()
    device = weights.device
    with torch.no_grad():
        weights.copy_(torch.tensor(START))
    ids = KeyedJaggedTensor.from_lengths_sync(keys=["cat_0"], values=torch.tensor([1, 2]), lengths=torch.tensor([1, 1]))
    pooled = model(ids.to(device))
    (pooled * torch.tensor(UPSTREAM, device=device)).sum().backward()  # the update runs inside this backward
    (weights,) = kernel.split_embedding_weights()
    return weights.cpu().tolist()


@pytest.mark.parametrize(("mode", "fbgemm_mode"), [("l2", WeightDecayMode.L2), ("decoupled", WeightDecayMode.DECOUPLE)])
def test_the_decay_reaches_the_fused_kernel_and_fbgemms_cpu_kernel_drops_it(one_rank_group, mode, fbgemm_mode):
    model, kernel = sharded_table("row_wise_adagrad", WEIGHT_DECAY, mode, torch.device("cpu"))
    assert kernel.optimizer == EmbOptimType.EXACT_ROWWISE_ADAGRAD
    assert kernel.weight_decay_mode == fbgemm_mode
    assert kernel.optimizer_args.weight_decay == WEIGHT_DECAY
    assert kernel.optimizer_args.weight_decay_mode == fbgemm_mode.value
    # FBGEMM's CPU row-wise Adagrad (fp32, a table per feature) calls fbgemm's SparseAdaGrad with
    # weight_decay=0: the step is the one without decay. Should a later FBGEMM apply it, this fails and
    # check_sparse_weight_decay_device's refusal on CPU can go.
    torch.testing.assert_close(torch.tensor(train_one_step(model, kernel)), torch.tensor(by_hand("row_wise_adagrad", None)))
    assert kernel.split_optimizer_states()[0][0].tolist() == pytest.approx([0.0, 0.41, 0.17, 0.0])


def test_no_decay_leaves_the_kernel_as_before(one_rank_group):
    _, kernel = sharded_table("row_wise_adagrad", 0.0, "decoupled", torch.device("cpu"))
    assert kernel.weight_decay_mode == WeightDecayMode.NONE and kernel.optimizer_args.weight_decay == 0.0


@pytest.mark.parametrize("optimizer", ["row_wise_adagrad", "adam"])
def test_fbgemms_weight_decay_arguments_reach_the_table_whatever_the_fused_optimizer(optimizer):
    # torch's Adam refused FBGEMM's weight_decay_mode when apply_optimizer_in_backward built it on the
    # table (found on an H200): the fused tables get a class that takes FBGEMM's arguments, mapped by
    # TorchRec to the same FBGEMM optimizer. Checked on meta parameters, before any sharding or device.
    tables = build_embedding_bag_collection(4, [4], "meta")
    fuse_sparse_optimizer(tables.parameters(), optimizer, LEARNING_RATE, WEIGHT_DECAY, "decoupled")
    (weight,) = tables.parameters()
    (optimizer_class,) = weight._optimizer_classes
    expected = {"row_wise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "adam": EmbOptimType.ADAM}[optimizer]
    assert optimizer_type_to_emb_opt_type(optimizer_class) == expected
    (kwargs,) = weight._optimizer_kwargs
    assert (kwargs["weight_decay"], kwargs["weight_decay_mode"]) == (WEIGHT_DECAY, WeightDecayMode.DECOUPLE)


def test_the_module_hands_its_settings_to_both_optimizers():
    module = DLRMModule(
        embedding_dim=4, num_embeddings_per_feature=8, dense_arch_layer_sizes=[4], over_arch_layer_sizes=[2, 1],
        sparse_weight_decay=1e-4, sparse_weight_decay_mode="decoupled", dense_optimizer="adam",
        dense_weight_decay=1e-3, dense_weight_decay_mode="decoupled",
    )  # fmt: skip
    tables = list(module.model.sparse_arch.parameters())
    assert len(tables) == 26
    for table in tables:  # what TorchRec's sharder merges into the kernel's arguments
        assert table._optimizer_kwargs == [
            {"lr": 0.05, "eps": 1e-8, "weight_decay": 1e-4, "weight_decay_mode": WeightDecayMode.DECOUPLE}
        ]
    (dense_group,) = dict(module.configure_optimizers().optimizers)["dense"].param_groups
    assert (dense_group["weight_decay"], dense_group["decoupled_weight_decay"]) == (1e-3, True)


class _DenseAndTable(nn.Module):
    """One dense weight and one table, named as in the app's DLRM."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Parameter(torch.tensor([2.0, -4.0, 0.5]))
        self.sparse_arch = nn.Module()
        self.sparse_arch.table = nn.Parameter(torch.ones(4, 2))


DENSE_GRADIENT = [1.0, 1.0, -0.5]


@pytest.mark.parametrize(
    ("optimizer", "mode", "expected"),
    [
        # w - lr * (g + decay * w) with lr 0.5, decay 0.1: [2 - 0.5 * 1.2, -4 - 0.5 * 0.6, 0.5 - 0.5 * (-0.45)].
        ("sgd", "l2", [1.4, -4.3, 0.725]),
        ("sgd", "decoupled", [1.4, -4.3, 0.725]),
        # Adagrad's first step from a zero sum: lr * g' / |g'| = lr * sign(g + decay * w) = 0.5 * [1, 1, -1].
        ("adagrad", "l2", [1.5, -4.5, 1.0]),
        # Adam's first step: lr * sign(g') as well, g' = g + decay * w.
        ("adam", "l2", [1.5, -4.5, 1.0]),
        # AdamW: (1 - lr * decay) * w - lr * sign(g) = 0.95 * w - 0.5 * [1, 1, -1].
        ("adam", "decoupled", [1.4, -4.3, 0.975]),
    ],
)
def test_dense_weight_decay_changes_torchs_step_by_the_amount_worked_out(optimizer, mode, expected):
    module = _DenseAndTable()
    combined = build_optimizer(
        module, table_prefix="sparse_arch.", sparse_optimizer="row_wise_adagrad", sparse_learning_rate=0.5,
        dense_optimizer=optimizer, dense_learning_rate=LEARNING_RATE, dense_weight_decay=WEIGHT_DECAY,
        dense_weight_decay_mode=mode,
    )  # fmt: skip
    parts = dict(combined.optimizers)
    group = parts["dense"].param_groups[0]
    assert group["weight_decay"] == WEIGHT_DECAY
    assert group.get("decoupled_weight_decay", False) is (optimizer == "adam" and mode == "decoupled")
    assert group["fused"] is True  # still torch's fused kernel
    assert parts["replicated_tables"].param_groups[0]["weight_decay"] == 0.0  # the tables' decay is FBGEMM's
    module.dense.grad = torch.tensor(DENSE_GRADIENT)
    module.sparse_arch.table.grad = torch.zeros(4, 2)
    combined.step()
    torch.testing.assert_close(module.dense.detach(), torch.tensor(expected))
    assert module.sparse_arch.table.tolist() == [[1.0, 1.0]] * 4


def test_tables_the_planner_replicated_are_refused_a_decay_naming_the_setting():
    module = _DenseAndTable()
    # Named as DMP names a replicated table of the app's DLRM, under its LightningModule.
    del module.sparse_arch.table
    module.sparse_arch.embedding_bag_collection = nn.Module()
    module.sparse_arch.embedding_bag_collection.embedding_bags = nn.ModuleDict({"t_cat_3": nn.EmbeddingBag(2, 2)})
    with pytest.raises(ValueError) as refused:
        build_optimizer(
            module, table_prefix="sparse_arch.", sparse_optimizer="row_wise_adagrad",
            sparse_learning_rate=0.5, dense_optimizer="adagrad", dense_learning_rate=0.5, sparse_weight_decay=1e-5,
        )  # fmt: skip
    message = str(refused.value)
    assert message.startswith("model.sparse_weight_decay = 1e-05: the planner replicated t_cat_3 (data_parallel)")
    assert "trainer.strategy.sharding_types" in message and "\n" not in message


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"sparse_weight_decay": -0.1}, "model.sparse_weight_decay = -0.1 must be a number >= 0"),
        ({"dense_weight_decay": float("nan")}, "model.dense_weight_decay = nan must be a number >= 0"),
        ({"sparse_weight_decay_mode": "counter"}, "model.sparse_weight_decay_mode = 'counter' is not one of l2, decoupled"),
        ({"sparse_optimizer": "sgd", "sparse_weight_decay": 0.1},
         "model.sparse_weight_decay = 0.1: FBGEMM's sgd kernel has no weight decay"),
        ({"sparse_optimizer": "adagrad", "sparse_weight_decay": 0.1},
         "model.sparse_weight_decay = 0.1: FBGEMM's adagrad kernel has no weight decay"),
        ({"sparse_optimizer": "adam", "sparse_weight_decay": 0.1},
         "model.sparse_weight_decay_mode = l2: FBGEMM's adam has only decoupled weight decay"),
        ({"dense_optimizer": "adagrad", "dense_weight_decay": 0.1, "dense_weight_decay_mode": "decoupled"},
         "model.dense_weight_decay_mode = decoupled: torch's adagrad has only l2 weight decay"),
    ],
)  # fmt: skip
def test_a_decay_or_mode_the_optimizer_does_not_apply_is_refused_naming_the_setting(settings, message):
    arguments = {
        "sparse_optimizer": "row_wise_adagrad", "sparse_weight_decay": 0.0, "sparse_weight_decay_mode": "l2",
        "dense_optimizer": "adagrad", "dense_weight_decay": 0.0, "dense_weight_decay_mode": "l2",
    } | settings  # fmt: skip
    with pytest.raises(ValueError) as refused:
        check_weight_decay(**arguments)
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model.sparse_weight_decay=-1e-5"], "model.sparse_weight_decay = -1e-05 must be a number >= 0"),
        (["--model.sparse_optimizer", "sgd", "--model.sparse_weight_decay", "1e-5"],
         "model.sparse_weight_decay = 1e-05: FBGEMM's sgd kernel has no weight decay"),
        (["--model.dense_weight_decay", "1e-5", "--model.dense_weight_decay_mode", "decoupled"],
         "model.dense_weight_decay_mode = decoupled: torch's adagrad has only l2 weight decay"),
    ],
)  # fmt: skip
def test_bad_weight_decay_stops_before_any_worker_with_one_line(args, message, sample_dir, capsys):
    refused_before_launch(args, message, sample_dir, capsys)


def test_sparse_decay_on_cpu_is_refused_before_the_first_step_and_evaluation_stays_allowed(sample, tmp_path):
    module = DLRMModule(embedding_dim=4, num_embeddings_per_feature=8, dense_arch_layer_sizes=[4],
                        over_arch_layer_sizes=[2, 1], sparse_weight_decay=1e-5)  # fmt: skip
    module.check_before_launch("cpu", "predict")  # the decay does not act outside training
    module.check_before_launch("cuda", "fit")
    # A real 1-process fit: refused by the CLI's check before any worker starts, with one line naming the setting.
    args = fit_args(sample, tmp_path, "table_wise", 64) + ["--model.sparse_weight_decay", "1e-5"]
    with rendezvous_port() as port:
        start_cli_ranks(1, port, args, None, tmp_path)
    error = pickle.loads((tmp_path / "rank0.pkl").read_bytes())["error"]
    assert error.startswith(
        "ValueError: model.sparse_weight_decay = 1e-05: FBGEMM's CPU embedding kernels drop the decay "
        "(row-wise Adagrad's fp32 path applies none), so it would be ignored; train on GPUs or set it to 0\n"
    )
    assert ", in instantiate_classes\n" in error and "training_step" not in error
