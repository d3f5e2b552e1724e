"""TorchRec's overlapped training pipelines, driven from inside Lightning's training loop.

``TrainPipelineSparseDist`` starts the input all-to-all of batch i+1 while batch i computes (and,
on GPUs, copies batch i+2 to the device meanwhile); ``TrainPipelineSemiSync`` also looks up the
embeddings of batch i+1 before batch i's embedding update, so each batch's lookup sees tables one
update old; ``TrainPipelineSparseDistLite`` keeps one batch in flight (its input all-to-all back on the
step's path, for less memory) and ``TrainPipelineFusedSparseDist`` looks a batch's embeddings up on their
own stream while the previous step's optimizer runs. All call forward, backward, ``optimizer.zero_grad()`` and ``optimizer.step()``
themselves, which is why a pipelined module uses Lightning's manual optimization and receives
``dataloader_iter`` instead of a batch. What this module adds around them, and why:

- The pipeline pulls up to two (semi-sync: three) batches ahead. Lightning's ``dataloader_iter``
  fetcher would count those as consumed, end the epoch two batches early and hand the callbacks a
  batch that has not been trained yet; ``_LightningFeed`` keeps its count at the batches *trained*,
  so epochs, ``val_check_interval``, ``max_steps`` and ``on_train_batch_end`` see one batch per step.
- A checkpoint written mid-epoch must resume at the first batch not yet trained: the resumable
  loader is told how many batches the pipeline holds (``ResumableBatchLoader.batches_in_flight``).
- The pipeline replaces the sharded modules' forward with one that reads its prefetched inputs, so
  evaluation through it would see training batches (facebookresearch/dlrm#271): the model is
  detached before every evaluation and at the end of fit, and re-attached for the next step.
- The optimizer it steps is Lightning's ``LightningOptimizer``: each step advances ``global_step``
  exactly once, and the fused embedding update stays inside backward, once per batch. Lightning
  does not clip gradients under manual optimization: ``clip_dense_gradients`` does, before each step.
- Lightning counts the steps of manual optimization (a pipelined step) and of automatic
  optimization (the plain loop) apart, and ``global_step`` reads only the running mode's count. A
  checkpoint resumed with the other loop (``model.pipeline`` changed, or ``auto`` choosing another on
  another world size) would restart at step 0: ``carry_step_count`` moves the count across on load.
"""

from __future__ import annotations

import inspect
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, Literal, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
import torchrec
from lightning.pytorch import LightningModule
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

from app.data.batches import CriteoBatch
from app.data.loader import ResumableBatchLoader

Pipeline = Literal["auto", "none", "sparse_dist", "semi_sync", "sparse_dist_lite", "fused_sparse_dist"]
PIPELINES = ("auto", "none", "sparse_dist", "semi_sync", "sparse_dist_lite", "fused_sparse_dist")

# The pipelines of TorchRec the setting names, by the class each drives (``none`` and ``auto`` drive none).
# ``sparse_dist_lite``: one batch in flight, its input all-to-all on the step's path (less memory than
# ``sparse_dist``); ``fused_sparse_dist``: the embedding lookup of a batch on its own stream, overlapping the
# previous step's optimizer (the tables were already updated inside the fused backward).
PIPELINE_CLASSES = {
    "sparse_dist": "TrainPipelineSparseDist",
    "semi_sync": "TrainPipelineSemiSync",
    "sparse_dist_lite": "TrainPipelineSparseDistLite",
    "fused_sparse_dist": "TrainPipelineFusedSparseDist",
}
# Pipelines that record CUDA streams on the batches they hold (``Tensor.record_stream``): on CPU they fail
# inside the first step ("unknown parameter type").
GPU_ONLY_PIPELINES = ("semi_sync", "fused_sparse_dist")


@runtime_checkable
class StepCallsModel(Protocol):
    """A LightningModule whose training step may run the sharded model itself: TorchRec's pipeline
    calls the DistributedModelParallel once per batch, so the strategy must then call the step
    directly instead of through the DMP's forward (which would run the DDP's forward twice, nested)."""

    @property
    def training_step_calls_model(self) -> bool:
        """Whether the step Lightning runs is the pipelined one (decided at set-up)."""
        ...


def check_pipeline(name: str) -> None:
    """Raises a ValueError naming ``model.pipeline`` for an unknown value, or for a pipeline the installed
    TorchRec lacks (``sparse_dist_lite`` came with torchrec 1.6)."""
    if name not in PIPELINES:
        raise ValueError(f"model.pipeline = {name!r} is not one of {', '.join(PIPELINES)}")
    if name in PIPELINE_CLASSES:
        pipeline_class(name)


def check_pipeline_device(name: str, device_type: str) -> None:
    """Raises a ValueError naming ``model.pipeline`` for a GPU-only pipeline on another device."""
    if name in GPU_ONLY_PIPELINES and device_type != "cuda":
        raise ValueError(
            f"model.pipeline = {name} needs GPUs: TorchRec's {PIPELINE_CLASSES[name]} does not run on {device_type}; "
            "use sparse_dist"
        )


def pipeline_class(name: str) -> type[TrainPipelineSparseDist]:
    """The TorchRec class ``model.pipeline = name`` drives; a ValueError naming the setting where the
    installed TorchRec has none of that name."""
    from torchrec.distributed.train_pipeline import train_pipelines

    found = getattr(train_pipelines, PIPELINE_CLASSES[name], None)
    if found is None:
        raise ValueError(
            f"model.pipeline = {name}: torchrec {torchrec.__version__} has no {PIPELINE_CLASSES[name]}; "
            "use sparse_dist or none"
        )
    return found


def resolve_pipeline(name: str, device: torch.device, world_size: int) -> str:
    """The pipeline ``auto`` stands for on ``device`` with ``world_size`` processes: sparse_dist
    wherever there is something to overlap (GPUs; CPU with an input all-to-all), else none."""
    check_pipeline_device(name, device.type)  # whether the installed TorchRec has it: check_pipeline, at __init__
    if name != "auto":
        return name
    # GPUs: the input all-to-all and host-to-device copies run on their own streams, hidden behind
    # compute. CPU with more than one process, measured 2026-11-23 on the 2-core machine with
    # `python -m app.bench` (torchrec_reference: 2 gloo processes of 1 thread, 26 tables x 100,000 x
    # 64, batch 512 per process), pooled over 5 bench runs of 4-8 alternating repeats, each ratio taken
    # against TorchRec's pipelined raw loop run next to it: the app's sparse_dist 1.00 (median of 22
    # pairs, quartiles 0.96-1.04), Lightning's plain loop 0.96 (28 pairs, quartiles 0.92-1.04). Single
    # runs disagree (pairs vary by +-10 % on this shared machine; one 5-repeat run had favoured the
    # plain loop), the pool does not: starting the next batch's input all-to-all early saves more than
    # the pipeline's bookkeeping costs. One CPU process has no all-to-all and no copy to hide: the
    # bookkeeping alone, about 0.45 ms per step (`python -m app.bench --preset overhead`, medians of 9
    # runs: TorchRec's pipelined loop 2.30 ms a step against its plain loop 1.85 ms; the app's
    # sparse_dist 3.12 ms against its plain loop 2.66 ms). Results are bit-identical either way.
    return "none" if device.type == "cpu" and world_size == 1 else "sparse_dist"


def _check_custom_forward(pipeline_class: type, name: str) -> None:
    # custom_model_fwd lets the loss stay in the LightningModule; older TorchRec lacks it.
    if "custom_model_fwd" not in inspect.signature(pipeline_class.__init__).parameters:
        raise ValueError(
            f"model.pipeline = {name}: {pipeline_class.__name__} of torchrec {torchrec.__version__} takes no "
            "custom_model_fwd; use model.pipeline = none"
        )


class _LightningFeed(Iterator[CriteoBatch]):
    """The iterator the TorchRec pipeline pulls from: Lightning's ``dataloader_iter``, unwrapped.

    Lightning yields ``(batch, batch_idx, dataloader_idx)``; the pipeline wants batches. The indices
    of the batches pulled but not yet trained wait here, so that the step that trains a batch can
    report that batch's index to Lightning.
    """

    def __init__(self, dataloader_iter: Any) -> None:
        self.dataloader_iter = dataloader_iter
        self.pending_batch_idx: deque[int] = deque()
        self.exhausted = False

    def __next__(self) -> CriteoBatch:
        try:
            batch, batch_idx, _ = next(self.dataloader_iter)
        except StopIteration:
            self.exhausted = True
            raise
        self.pending_batch_idx.append(batch_idx)
        return batch


class _LightningOptimizerOf:
    """The module's current LightningOptimizer, looked up on every call: Lightning re-creates that
    wrapper (e.g. around evaluation), and only the current one's ``step`` advances ``global_step``."""

    def __init__(self, module: LightningModule) -> None:
        self.module = module

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.module.optimizers().param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.module.optimizers().zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        clip_dense_gradients(self.module)
        self.module.optimizers().step()


def clip_dense_gradients(module: LightningModule) -> None:
    """``trainer.gradient_clip_val`` / ``gradient_clip_algorithm`` applied as the plain loop applies them.

    Under manual optimization Lightning never clips (``Precision._clip_gradients`` returns early, and
    its configuration check that refuses clipping with manual optimization runs before the module's
    ``setup`` turns it on): the pipeline's step calls the module's ``configure_gradient_clipping``
    itself, between the backward the pipeline ran and the optimizer step, with the same arguments
    Lightning's automatic loop passes. The module's hook clips the dense part only (already
    all-reduced by DDP in backward), as in the plain loop: tables with a fused optimizer were updated
    inside backward by FBGEMM, and replicated tables are left as their sharded kind would be.
    (Unlike the plain loop, the clipping comes before the ``on_before_optimizer_step`` hooks.)
    """
    trainer = module.trainer
    optimizer = module.optimizers(use_pl_optimizer=False)
    module.configure_gradient_clipping(
        optimizer, gradient_clip_val=trainer.gradient_clip_val, gradient_clip_algorithm=trainer.gradient_clip_algorithm
    )


class PipelinedTraining:
    """Trains one batch per call with a TorchRec training pipeline, keeping Lightning's books right.

    Args:
        name: a pipeline of ``PIPELINE_CLASSES`` (``sparse_dist``, ``semi_sync``, ...).
        module: the LightningModule; its strategy's model must be TorchRec's DistributedModelParallel.
        loss_fn: click loss of (logits, batch), the same function the plain loop uses.
        semi_sync_start_step: pipeline batches trained synchronously before semi-sync starts.
    """

    def __init__(
        self,
        name: str,
        module: LightningModule,
        loss_fn: Callable[[torch.Tensor, CriteoBatch], torch.Tensor],
        semi_sync_start_step: int,
    ) -> None:
        self.module = module
        self.loss_fn = loss_fn
        self._feed: _LightningFeed | None = None
        self._trained_batch: CriteoBatch | None = None
        self._paused = False
        model = module.trainer.strategy.model  # DistributedModelParallel around the LightningModule
        device = module.trainer.strategy.root_device
        kwargs: dict[str, Any] = dict(
            model=model, optimizer=_LightningOptimizerOf(module), device=device, custom_model_fwd=self._forward
        )
        driven = pipeline_class(name)
        _check_custom_forward(driven, name)
        if "execute_all_batches" in inspect.signature(driven.__init__).parameters:
            kwargs["execute_all_batches"] = True  # the lite pipeline always does, and takes no such argument
        if name == "semi_sync":
            kwargs["start_batch"] = semi_sync_start_step
        self.pipeline = driven(**kwargs)
        self._model = model

    def _forward(self, batch: CriteoBatch) -> tuple[torch.Tensor, torch.Tensor]:
        # Called by the pipeline through DMP (and the DDP around the dense part), so the dense
        # gradients are all-reduced in the backward the pipeline runs.
        # The forward and the loss under the precision's autocast, as Lightning's plain loop runs
        # training_step, and not the pipeline's backward and step: a CPU backward runs on this thread
        # and under autocast would compute its matmuls in bf16 again (the two loops then differ).
        self._trained_batch = batch
        with self.module.trainer.strategy.precision_plugin.train_step_context():
            logits = self._model(batch)
            loss = self.loss_fn(logits, batch)
        return loss, loss.detach()

    def step(self, dataloader_iter: Any) -> tuple[torch.Tensor, CriteoBatch]:
        """Trains the next batch in line; returns its loss and the batch itself."""
        self.resume()
        if not self._model.training:
            # Lightning restores the training mode of the LightningModule after evaluation, not of
            # the DMP around it, and the pipeline runs backward and step only when that is training.
            self._model.train()
        if self._feed is None or self._feed.dataloader_iter is not dataloader_iter:
            self._feed = _LightningFeed(dataloader_iter)  # a new epoch
        fetcher = dataloader_iter.data_fetcher
        queued_before = len(self.pipeline.batches)
        loss = self.pipeline.progress(self._feed)
        queued_after = len(self.pipeline.batches)
        # Lightning counted every pull as a batch trained; the ones still queued are not (yet).
        # (Private fields of Lightning's _DataLoaderIterDataFetcher: no public way to say this.)
        fetcher.fetched -= queued_after - queued_before
        fetcher.done = self._feed.exhausted and queued_after == 0
        fetcher._batch = self._trained_batch
        fetcher._batch_idx = self._feed.pending_batch_idx.popleft()
        self._tell_loader(queued_after)
        assert self._trained_batch is not None
        return loss, self._trained_batch

    def _tell_loader(self, batches_in_flight: int) -> None:
        loader = self.module.trainer.train_dataloader
        if isinstance(loader, ResumableBatchLoader):
            loader.batches_in_flight = batches_in_flight

    def pause(self) -> None:
        """Gives the model its own forward back (for evaluation); the queued batches stay queued."""
        if not self._paused:
            self.pipeline.detach()
            self._paused = True

    def resume(self) -> None:
        """Routes the sharded modules through the pipeline again after ``pause``."""
        if self._paused:
            # The queued batches' input all-to-all has already run: do not start it again.
            self.pipeline.attach(self._model, sparse_dist=False)
            self._paused = False

    def stop(self) -> None:
        """At the end of fit: the model's own forward back, batches beyond the last step dropped."""
        self.pause()
        self.pipeline.reset()
        self._feed = None


_AUTOMATIC_STEPS = "epoch_loop.automatic_optimization.optim_progress"
_MANUAL_STEPS = "epoch_loop.manual_optimization.optim_step_progress"


def carry_step_count(checkpoint: dict[str, Any], automatic_optimization: bool) -> None:
    """Puts the optimizer steps a checkpoint counted under either optimization mode into the mode this
    run uses (in place, before Lightning restores its loops), so that ``global_step``, ``max_steps``
    and step-based checkpoints continue where the checkpoint stopped."""
    fit_loop = checkpoint.get("loops", {}).get("fit_loop", {})
    if _AUTOMATIC_STEPS not in fit_loop or _MANUAL_STEPS not in fit_loop:
        return  # not a training checkpoint of this Lightning's loops (e.g. an exported model)
    automatic = fit_loop[_AUTOMATIC_STEPS]["optimizer"]["step"]  # {"total"/"current": {"ready", "completed"}}
    manual = fit_loop[_MANUAL_STEPS]
    kept, emptied = (automatic, manual) if automatic_optimization else (manual, automatic)
    for scope in ("total", "current"):
        for field in ("ready", "completed"):
            kept[scope][field] += emptied[scope][field]
            emptied[scope][field] = 0


def click_loss(logits: torch.Tensor, batch: CriteoBatch) -> torch.Tensor:
    """Binary cross-entropy of the click logits, in float32 whatever the compute precision."""
    return F.binary_cross_entropy_with_logits(logits.float(), batch.labels)

