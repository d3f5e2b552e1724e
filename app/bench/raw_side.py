"""The baseline: a plain TorchRec training loop on one rank, no Lightning, the way TorchRec's own DLRM
trainers are written (torchrec ``examples/golden_training/train_dlrm.py``, facebookresearch/dlrm
``torchrec_dlrm/dlrm_main.py``): tables on the meta device with their optimizer fused into backward,
``DistributedModelParallel`` with a planned sharding, a keyed dense optimizer combined with the fused
one, and ``TrainPipelineSparseDist.progress`` in a loop, overlapping the next batch's input
all-to-all with this batch's compute.

It uses the app's model builder, optimizer choices and planner inputs, so that the two sides train
the same model with the same optimizers under the same plan; none of those involve Lightning. With a
dataset it iterates the app's own data module's training loader, epoch after epoch.
"""

from __future__ import annotations

import os
from datetime import timedelta
from itertools import islice
from typing import Any

import torch
import torch.distributed as dist
from torchrec.distributed import TrainPipelineBase, TrainPipelineSparseDist
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.types import ShardingEnv
from torchrec.models.dlrm import DLRMTrain
from torchrec.optim.keyed import CombinedOptimizer

from app.bench.data import pins_batches, random_loader
from app.bench.dataset import epochs, open_dataset
from app.bench.measure import StepClock
from app.bench.settings import BenchSpec
from app.bench.trained_batches import TrainedBatches
from app.data.datamodule import CriteoDataModule
from app.distributed.sharding import build_constraints, default_sharders, embedding_table_names, plan_sharding
from app.distributed.threads import set_worker_threads
from app.distributed.topology import resolve_topology
from app.model.dlrm import build_dlrm, build_dlrm_arguments
from app.train.optimizers import build_optimizer, fuse_sparse_optimizer

def run_raw(
    spec: BenchSpec, clock: StepClock, trained: TrainedBatches, rank: int, device: torch.device, overlap: bool = True
) -> dict[str, Any]:
    """Trains ``spec.total_steps`` steps, timed by ``clock``, each batch trained added to ``trained``;
    returns the model and the plan for the report.

    ``overlap=False`` drives the same loop with TorchRec's ``TrainPipelineBase`` (copy, forward,
    backward, step; nothing overlapped), which separates what the overlap gains from what Lightning costs.
    """
    model_args, strategy = spec.model_args(), spec.strategy
    backend = "gloo" if device.type == "cpu" else "nccl"
    dist.init_process_group(backend, timeout=timedelta(seconds=strategy.get("timeout_s", 1800.0)))
    # As many threads as the app gives its workers, so that the two sides compare like with like.
    set_worker_threads(spec.run.world_size, strategy.get("num_threads_per_process"), os.environ.get("OMP_NUM_THREADS"))
    # Before the clock's set-up mark, as Lightning sets up the app's data module before its callbacks.
    dataset = _set_up_dataset(spec)
    clock.mark_setup()

    dlrm = build_dlrm(**build_dlrm_arguments(model_args), embedding_device="meta")
    fuse_sparse_optimizer(dlrm.sparse_arch.parameters(), model_args["sparse_optimizer"], model_args["sparse_learning_rate"])
    train_model = DLRMTrain(dlrm)  # returns (loss, outputs), the interface the pipeline drives
    sharders = default_sharders()
    # The planner inputs TorchRecStrategy uses, so that both sides plan with the same topology.
    plan = plan_sharding(
        train_model,
        device=resolve_topology(strategy.get("topology", "auto"), strategy.get("topology_overrides"), device),
        world_size=spec.run.world_size,
        local_world_size=spec.run.world_size,
        sharders=sharders,
        constraints=build_constraints(
            embedding_table_names(train_model), strategy.get("sharding_types"), strategy.get("table_constraints") or {}
        ),
        batch_size_per_rank=spec.planner_batch_size,  # what the app's strategy reads from its data module
        objective=strategy.get("planner_objective", "performance"),
        process_group=dist.group.WORLD,
    ).plan
    model = DistributedModelParallel(
        train_model, env=ShardingEnv.from_process_group(dist.group.WORLD), device=device, plan=plan, sharders=sharders
    )
    dense_optimizer = build_optimizer(
        train_model,
        table_prefix="model.sparse_arch.",
        sparse_optimizer=model_args["sparse_optimizer"],
        sparse_learning_rate=model_args["sparse_learning_rate"],
        dense_optimizer=model_args["dense_optimizer"],
        dense_learning_rate=model_args["dense_learning_rate"],
    )
    optimizer = CombinedOptimizer([("sparse", model.fused_optimizer), ("dense", dense_optimizer)])
    pipeline_class = TrainPipelineSparseDist if overlap else TrainPipelineBase
    pipeline = pipeline_class(model, optimizer, device)

    # The loader made here, as Lightning makes the app's after set-up.
    if dataset is not None:
        batches = epochs(dataset.train_dataloader())
    else:
        batches = iter(random_loader(spec.data, spec.total_steps, spec.run.seed + rank, pins_batches(device)))
    batches = trained.recording(islice(batches, spec.total_steps))  # the pipeline trains every batch it pulls
    for step in range(spec.total_steps):
        pipeline.progress(batches)
        clock.step_ended()
    dist.destroy_process_group()
    return {"plan": plan, "module": train_model}


def _set_up_dataset(spec: BenchSpec) -> CriteoDataModule | None:
    """The app's data module for a dataset, set up for this rank (from the process group), as the
    Trainer sets it up on the app's side; None for random batches."""
    if spec.dataset is None:
        return None
    data = open_dataset(spec.dataset)
    data.setup("fit")  # the parent prepared the data (converted raw TSV) before any process started
    return data
