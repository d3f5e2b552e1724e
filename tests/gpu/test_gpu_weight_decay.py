"""Weight decay in FBGEMM's GPU embedding kernels: after DMP shards the app's table with the decay fused
as the app fuses it (model.sparse_weight_decay), one step moves the looked-up rows by the amount worked
out by hand in tests/train/test_weight_decay.py (``by_hand``) and leaves the other rows alone. On CPU FBGEMM
drops the decay, which the CPU suite shows and the app refuses there."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from fbgemm_gpu.split_table_batched_embeddings_ops_training import WeightDecayMode

from tests.train.test_weight_decay import by_hand, sharded_table, train_one_step

# Skipped without a usable GPU by tests/gpu/conftest.py, with the reason, as every check of this folder.
pytestmark = pytest.mark.gpu


@pytest.fixture
def one_gpu_group(tmp_path):
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize(
    ("optimizer", "mode", "fbgemm_mode"),
    [
        ("row_wise_adagrad", "l2", WeightDecayMode.L2),
        ("row_wise_adagrad", "decoupled", WeightDecayMode.DECOUPLE),
        ("adam", "decoupled", WeightDecayMode.DECOUPLE),  # FBGEMM's Adam decouples whatever the mode says
    ],
)
def test_the_gpu_kernel_moves_the_looked_up_rows_by_the_decay_worked_out(one_gpu_group, optimizer, mode, fbgemm_mode, record_property):
    model, kernel = sharded_table(optimizer, 0.1, mode, torch.device("cuda", 0))
    assert (kernel.optimizer_args.weight_decay, kernel.weight_decay_mode) == (0.1, fbgemm_mode)
    after = train_one_step(model, kernel)
    record_property("table_after_one_step", after)
    torch.testing.assert_close(torch.tensor(after), torch.tensor(by_hand(optimizer, mode)))
    without = train_one_step(*sharded_table(optimizer, 0.0, mode, torch.device("cuda", 0)))
    assert not torch.allclose(torch.tensor(without)[1:3], torch.tensor(after)[1:3], atol=1e-3)  # the decay's share
