"""The LightningModule: a DLRM, its click loss, its optimizers and its metrics."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torchmetrics import MetricCollection

from app.criteo import expand_table_sizes
from app.data.batches import CriteoBatch
from app.data.datamodule import CriteoDataModule, counted_table_sizes
from app.model.compile import (
    FirstStepTimer,
    check_compile_mode,
    check_compile_supported,
    compile_dense_layers,
    compiled_layer_names,
    mark_cuda_graph_step,
    records_cuda_graphs,
)
from app.model.dlrm import EmbeddingPrecision, Interaction, build_dlrm, check_embedding_precision
from app.train.fused_step_count import FusedStepCount
from app.train.log_steps import RunningMean, metrics_written_after_this_batch
from app.train.lr_schedule import LRSchedule, lr_scheduler_config, restore_scheduled_rates, step_lr_schedulers
from app.train.host_group import host_process_group
from app.train.metrics import (
    EvalMetrics,
    GroupAUC,
    available_host_bytes,
    build_eval_metrics,
    check_exact_auc_memory,
    sync_exact_auc_through,
)
from app.train.optimizers import (
    DenseOptimizer,
    SparseOptimizer,
    WeightDecayModeName,
    build_optimizer,
    check_learning_rates,
    check_optimizer_names,
    check_sparse_weight_decay_device,
    check_weight_decay,
    dense_layers_optimizer,
    fuse_sparse_optimizer,
)
from app.train.pipeline import (
    Pipeline,
    PipelinedTraining,
    carry_step_count,
    check_pipeline,
    check_pipeline_device,
    click_loss,
    resolve_pipeline,
)


class DLRMModule(LightningModule):
    """Trains a DLRM click-through-rate model with binary cross-entropy on the click logit.

    The embedding tables are created on the meta device and only materialised, shard by shard, when
    the strategy wraps the module in TorchRec's DistributedModelParallel.

    Args:
        interaction: how embeddings meet: ``dot`` (DLRM), ``cat`` (concatenation, as in the original
            paper's alternative), ``dcn`` (DCNv2 low-rank cross layers) or ``projection``.
        embedding_dim: D, the width of every embedding table and of the bottom MLP's output.
        num_embeddings_per_feature: rows of each of the 26 tables (one int for all, or 26 ints; fewer
            ints give tables for the first features only, for benchmarks); with ``data.schema``'s own
            features, one int per categorical feature (those sharing a table: the same). Linked from
            ``data.num_embeddings_per_feature``; None (its ``auto``): the data module's count, known in
            ``setup``, where the tables are then built.
        dense_arch_layer_sizes: bottom MLP layer sizes over the 13 dense features; must end with D.
        over_arch_layer_sizes: top MLP layer sizes; must end with 1.
        dcn_num_layers: cross layers of the ``dcn`` interaction.
        dcn_low_rank_dim: rank of each cross layer's weight in the ``dcn`` interaction.
        interaction_branch1_layer_sizes: first projection MLP of the ``projection`` interaction.
        interaction_branch2_layer_sizes: second projection MLP of the ``projection`` interaction.
        sparse_optimizer: optimizer fused into the embedding backward: row_wise_adagrad, adagrad, sgd or adam.
        sparse_learning_rate: learning rate of the embedding tables.
        dense_optimizer: optimizer of the MLPs and interaction layers: adagrad, adam or sgd.
        dense_learning_rate: learning rate of the dense parameters.
        sparse_weight_decay: weight decay of the embedding tables (0: none), applied by FBGEMM's fused
            kernel to the rows each batch looks up, at that step; row_wise_adagrad and adam, on GPUs
            (FBGEMM's CPU kernels drop it: refused on CPU). No table may then be replicated
            (data_parallel): see docs/training.md, "Regularisation".
        sparse_weight_decay_mode: ``l2`` (decay x weight added to the row's gradient, Adagrad's
            accumulator included; row_wise_adagrad) or ``decoupled`` (the row scaled by 1 - lr x decay;
            row_wise_adagrad, and adam, whose kernel has only this mode).
        dense_weight_decay: torch's weight decay of the dense parameters (0: none).
        dense_weight_decay_mode: ``l2`` (adagrad, adam, sgd) or ``decoupled`` (adam, as AdamW; sgd,
            where the two are the same update).
        eval_metrics: ``exact`` AUC keeps every validation/test prediction in host memory and
            gathers them on every rank (eval sets that fit there: refused before training when the
            host's ranks would need more than it has, app/train/metrics.py); ``binned`` counts
            predictions against ``auc_num_thresholds`` evenly spaced thresholds in constant memory
            (eval sets of billions) and also logs ``auc_max_error``, the most it can differ from the
            exact AUC. Log loss, NE, calibration and accuracy are exact running sums in both.
        auc_num_thresholds: thresholds of the ``binned`` AUC; its error is at most about 0.5 /
            auc_num_thresholds for predictions spread over [0, 1], more when they crowd into few bins.
        pipeline: how a training step runs. ``none``: Lightning's plain loop, one batch after the
            other. ``sparse_dist``: TorchRec's TrainPipelineSparseDist, which starts the input
            all-to-all of the next batch while this one computes; the same results as ``none``,
            bit for bit. ``semi_sync`` (GPUs only): TorchRec's TrainPipelineSemiSync, which also
            looks up the next batch's embeddings before this batch updates them (one update of
            lag, from ``semi_sync_start_step`` on). ``sparse_dist_lite`` (torchrec 1.6+): TorchRec's
            TrainPipelineSparseDistLite, one batch in flight and its input all-to-all on the step's
            path, for less memory; the same results as ``none``. ``fused_sparse_dist`` (GPUs only):
            TorchRec's TrainPipelineFusedSparseDist, which looks each batch's embeddings up on their own
            stream while the previous step's optimizer runs. ``auto``: ``sparse_dist`` on GPUs and on CPU with more than
            one process (measured the faster one there), ``none`` on one CPU process, which has no
            all-to-all to overlap (see app/train/pipeline.py).
        semi_sync_start_step: batches trained synchronously (counted from the start of this
            process) before ``semi_sync`` lets lookups lag; TorchRec's default is 900.
        lr_warmup_steps: steps of linear learning-rate warm-up from base/steps to base (0: none).
        lr_decay_start: step at which the polynomial decay starts (MLPerf DLRMv2's schedule).
        lr_decay_steps: steps the decay lasts (0: no decay); the rate then stays at its end value.
        lr_decay_power: power of the polynomial decay (MLPerf DLRMv2: 2).
        lr_decay_end_factor: floor of the decay, as a fraction of the base learning rate.
            The schedule applies to the dense and the embedding optimizer alike (app/train/lr_schedule.py)
            and is logged as ``train/lr`` (dense) and ``train/lr_embedding``.
        compile: compile the dense layers (bottom MLP, interaction, top MLP) with ``torch.compile``;
            the embedding part stays eager (app/model/compile.py). The first training step and the
            first evaluation batch wait for the compiler (~10 s here, printed once). Off by default: on
            2 CPU processes it measured no faster than eager, and on one H200 it cut the dense kernels'
            time but not the step's, which the host's launches bound (docs/performance.md).
            Checkpoints move between compiled and eager runs.
        compile_mode: ``torch.compile``'s mode for the dense layers (with ``compile``): ``default``;
            ``reduce-overhead`` replays each step's dense forward and backward as CUDA graphs, one launch
            instead of one per kernel, for steps bound by the host's launches (GPUs only; not yet run on
            a GPU, docs/performance.md); ``max-autotune`` (CUDA graphs too) and
            ``max-autotune-no-cudagraphs`` also try kernel variants while compiling (minutes).
        embedding_precision: ``fp32`` or ``fp16`` weights of the embedding tables in FBGEMM's kernels
            (fp16: half the memory and half the lookup bytes, with stochastic rounding of the updates;
            GPUs only: FBGEMM's CPU kernels round fp16 updates to nearest, refused on CPU).
        first_order: add to the click logit, per feature, the first component of the id's embedding: a
            learned bias per id (a factorization machine's first-order term; DLRM has none), at no extra
            lookup. Measured on data whose truth has per-id effects: see docs/quality.md.
        second_order: add to the click logit the sum over pairs of features of their embeddings' dot
            product (after the first component with ``first_order``): a factorization machine's
            pairwise term beside the MLP, as DeepFM has; no new parameters. Measured on data whose
            truth has pairwise effects: see docs/quality.md.
        features: the model's inputs, linked from ``data.schema`` (its dense columns, and its categorical
            columns with their tables, dims and pooling); None: Criteo's 13 dense and 26 categorical features.
    """

    # How a run trains or evaluates, not what the model is: a run from a checkpoint may set these anew
    # (app/checkpoint/saved_model.py); every other hyper-parameter is the checkpoint's.
    RUN_SETTINGS = frozenset({
        "sparse_learning_rate", "dense_optimizer", "dense_learning_rate", "sparse_weight_decay",
        "sparse_weight_decay_mode", "dense_weight_decay", "dense_weight_decay_mode", "eval_metrics",
        "auc_num_thresholds", "pipeline", "semi_sync_start_step", "lr_warmup_steps", "lr_decay_start",
        "lr_decay_steps", "lr_decay_power", "lr_decay_end_factor", "compile", "compile_mode",
    })  # fmt: skip

    def __init__(
        self,
        interaction: Interaction = "dot",
        embedding_dim: int = 64,
        num_embeddings_per_feature: int | list[int] | None = 100_000,
        dense_arch_layer_sizes: list[int] = [512, 256, 64],
        over_arch_layer_sizes: list[int] = [512, 512, 256, 1],
        dcn_num_layers: int = 3,
        dcn_low_rank_dim: int = 512,
        interaction_branch1_layer_sizes: list[int] = [2048, 2048],
        interaction_branch2_layer_sizes: list[int] = [2048, 2048],
        sparse_optimizer: SparseOptimizer = "row_wise_adagrad",
        sparse_learning_rate: float = 0.05,
        dense_optimizer: DenseOptimizer = "adagrad",
        dense_learning_rate: float = 0.05,
        sparse_weight_decay: float = 0.0,
        sparse_weight_decay_mode: WeightDecayModeName = "l2",
        dense_weight_decay: float = 0.0,
        dense_weight_decay_mode: WeightDecayModeName = "l2",
        eval_metrics: EvalMetrics = "exact",
        auc_num_thresholds: int = 10_000,
        pipeline: Pipeline = "auto",
        semi_sync_start_step: int = 900,
        lr_warmup_steps: int = 0,
        lr_decay_start: int = 0,
        lr_decay_steps: int = 0,
        lr_decay_power: float = 2.0,
        lr_decay_end_factor: float = 0.0,
        compile: bool = False,
        compile_mode: str = "default",
        embedding_precision: EmbeddingPrecision = "fp32",
        first_order: bool = False,
        second_order: bool = False,
        features: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        check_optimizer_names(sparse_optimizer, dense_optimizer)
        check_learning_rates(sparse_learning_rate, dense_learning_rate)
        check_weight_decay(
            sparse_optimizer, sparse_weight_decay, sparse_weight_decay_mode,
            dense_optimizer, dense_weight_decay, dense_weight_decay_mode,
        )  # fmt: skip
        check_pipeline(pipeline)
        check_compile_mode(compile_mode, compile)
        self._cuda_graphs = compile and records_cuda_graphs(compile_mode)
        self._pipelined: PipelinedTraining | None = None
        self._pipelined_step = False  # model.pipeline resolved to a pipeline, at set-up (training_step)
        self._train_loss = RunningMean()
        self.lr_schedule = LRSchedule(
            lr_warmup_steps, lr_decay_start, lr_decay_steps, lr_decay_power, lr_decay_end_factor
        )
        self._first_compiled_step = FirstStepTimer()
        self._fused_step_count = FusedStepCount()
        # Sizes None (`data.num_embeddings_per_feature: auto`): the model is built in setup, once the data
        # module has counted them behind the strategy's barrier. Its dense layers then draw their initial
        # weights from the random state of now, as when built here: the same model whether sizes were set
        # or counted.
        self._waits_for_table_sizes = num_embeddings_per_feature is None
        self._rng_state_at_init = torch.get_rng_state() if self._waits_for_table_sizes else None
        if not self._waits_for_table_sizes:
            self._build_model(num_embeddings_per_feature)
        else:
            # A stand-in of one row per table, all on the meta device and drawing nothing from the random
            # state: its settings are checked now, before any launch, not once the sizes are known.
            with torch.random.fork_rng(devices=[]), torch.device("meta"):
                self._build_model(1)
        self.val_metrics = build_eval_metrics("val/", eval_metrics, auc_num_thresholds)
        self.test_metrics = build_eval_metrics("test/", eval_metrics, auc_num_thresholds)
        # GAUC, where the data has a group column (data.schema.group): exact, every row gathered.
        self.val_gauc, self.test_gauc = GroupAUC(), GroupAUC()  # attributes: Lightning logs metrics it can name

    def _build_model(self, num_embeddings_per_feature: int | list[int]) -> None:
        """The DLRM with its tables on the meta device and the sparse optimizer fused into them."""
        hp = self.hparams
        self.model = build_dlrm(
            interaction=hp.interaction,
            embedding_dim=hp.embedding_dim,
            num_embeddings_per_feature=_table_sizes(num_embeddings_per_feature, hp.features),
            dense_arch_layer_sizes=hp.dense_arch_layer_sizes,
            over_arch_layer_sizes=hp.over_arch_layer_sizes,
            dcn_num_layers=hp.dcn_num_layers,
            dcn_low_rank_dim=hp.dcn_low_rank_dim,
            interaction_branch1_layer_sizes=hp.interaction_branch1_layer_sizes,
            interaction_branch2_layer_sizes=hp.interaction_branch2_layer_sizes,
            embedding_device="meta",
            embedding_precision=hp.embedding_precision,
            first_order=hp.first_order,
            second_order=hp.second_order,
            features=hp.features,
        )
        # Set before sharding: the sharder reads it to build the update into the embedding kernels.
        fuse_sparse_optimizer(
            self.model.sparse_arch.parameters(), hp.sparse_optimizer, hp.sparse_learning_rate,
            hp.sparse_weight_decay, hp.sparse_weight_decay_mode,
        )  # fmt: skip

    def _build_model_with_counted_sizes(self) -> None:
        """Builds the tables that waited for `auto` sizes, with the data module's count; the checkpoint's
        hyper-parameters then record the sizes, so that it carries its model."""
        if not self._waits_for_table_sizes:
            return
        sizes = counted_table_sizes(self.trainer)
        self.hparams.num_embeddings_per_feature = sizes
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(self._rng_state_at_init)
            self._build_model(sizes)
        self._waits_for_table_sizes = False

    def forward(self, batch: CriteoBatch) -> torch.Tensor:
        """Click logits (B,) for a batch."""
        if self._cuda_graphs:
            # Every step runs this forward once (the plain loop, TorchRec's pipeline through the DMP, evaluation
            # and predict): one CUDA-graph step per training or evaluation step.
            mark_cuda_graph_step()
        logits = self.model(batch.dense_features, batch.sparse_features).squeeze(-1)
        # Under CUDA graphs the top MLP's output lives in memory its next replay overwrites: a caller that
        # keeps the logits past the step (a callback, a prediction writer) must hold its own copy (B floats).
        return logits.clone() if self._cuda_graphs else logits

    def check_before_launch(self, device_type: str, stage: str | None = None) -> None:
        """The module's settings that this machine cannot run, refused naming the setting: the CLI calls
        it before any worker starts, ``setup`` again for every other caller. ``stage`` (Lightning's:
        fit, validate, test, predict) adds the checks of training alone, where known."""
        check_embedding_precision(self.hparams.embedding_precision, device_type)
        if stage == "fit":  # the decay and the pipeline act in training only: evaluating such a model on CPU is fine
            check_sparse_weight_decay_device(self.hparams.sparse_weight_decay, device_type)
            check_pipeline_device(self.hparams.pipeline, device_type)
        if self.hparams.compile:
            check_compile_supported(device_type, self.hparams.compile_mode)

    def setup(self, stage: str) -> None:
        self._build_model_with_counted_sizes()  # the data module's setup has run: Lightning calls it first
        device_type = self.trainer.strategy.root_device.type
        self.check_before_launch(device_type, stage)
        if self.hparams.compile and not compiled_layer_names(self.model):
            compile_dense_layers(self.model, device_type, self.hparams.compile_mode)  # compiles at the first forward; the keys stay the same
        # Known only once the trainer exists: the device and world size decide what "auto" means.
        if stage == "fit" and self._resolved_pipeline() != "none":
            self.automatic_optimization = False
            self._pipelined_step = True
        if self.hparams.eval_metrics == "exact" and stage in ("fit", "validate", "test"):
            self._set_up_exact_auc("test" if stage == "test" else "val")
        if _eval_groups(self.trainer.datamodule, "test" if stage == "test" else "val") is not None:
            group = host_process_group()  # a collective: every rank has the same schema, so all call it
            self.val_gauc.process_group = self.test_gauc.process_group = group

    def _set_up_exact_auc(self, split: str) -> None:
        """Refuses (or warns about) an eval set too large for exact AUC in host memory, then gives
        the exact AUC a group that gathers host memory (called on every rank: a collective)."""
        num_rows = _eval_rows(self.trainer.datamodule, split)
        warning = refusal = None
        if num_rows is not None:
            try:
                warning = check_exact_auc_memory(num_rows, split, self.trainer.num_devices, available_host_bytes())
            except ValueError as error:
                refusal = str(error)
        # Decided together: hosts differ in free memory, and a rank refusing alone would leave the
        # others waiting in their next collective until the timeout.
        if self.trainer.strategy.reduce_boolean_decision(refusal is not None, all=False):
            raise ValueError(refusal or "model.eval_metrics = exact: another machine of this run lacks the host memory "
                             "for the exact AUC (its rank's error says how much); use model.eval_metrics: binned")
        if warning:
            rank_zero_warn(warning)
        group = host_process_group()
        sync_exact_auc_through(self.val_metrics, group)
        sync_exact_auc_through(self.test_metrics, group)

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        # Lightning's default copies only plain tensors non_blocking (fabric's move_data_to_device);
        # a CriteoBatch is copied by its own .to: asked the same way here. From the loader's pinned
        # memory the copy then overlaps the host's work instead of stalling it.
        if isinstance(batch, CriteoBatch):
            return batch.to(device, non_blocking=device.type not in ("cpu", "mps"))
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def _resolved_pipeline(self) -> str:
        return resolve_pipeline(self.hparams.pipeline, self.trainer.strategy.root_device, self.trainer.world_size)

    @property
    def training_step(self) -> Callable[..., torch.Tensor]:  # type: ignore[override]
        """The step Lightning runs: ``plain_training_step``, or ``pipelined_training_step`` under
        ``model.pipeline``. Lightning hands a step a batch or its ``dataloader_iter`` by the parameter
        names of what it finds here, and the pipeline is known only at set-up (``auto`` depends on the
        device and world size): a property of the class, so that no method is rebound on the instance."""
        return self.pipelined_training_step if self._pipelined_step else self.plain_training_step

    @property
    def training_step_calls_model(self) -> bool:
        """Whether the step runs the sharded model itself (the pipelined one): the strategy then calls it
        directly, not through the model's forward (``app.train.pipeline.StepCallsModel``)."""
        return self._pipelined_step

    def plain_training_step(self, batch: CriteoBatch, batch_idx: int) -> torch.Tensor:
        """One batch through the model and the click loss; Lightning's loop steps the optimizers."""
        if not self.lr_schedule.is_constant:
            self._hand_scheduled_rate_to_fused_tables()
        loss = click_loss(self(batch), batch)
        self._log_training_step(loss, batch)
        return loss

    def _hand_scheduled_rate_to_fused_tables(self) -> None:
        """Gives FBGEMM's fused kernels this step's scheduled rate before the forward.

        TorchRec's fused optimizers hand their group's rate to FBGEMM in ``zero_grad()`` and ``step()``,
        but FBGEMM's CPU kernels take the rate when the forward runs: Lightning's plain loop calls
        ``zero_grad()`` after the forward, so the tables trained one step behind the schedule (the
        pipeline's step calls it before). ``zero_grad()`` of a fused optimizer zeroes nothing.
        """
        parts = dict(self.optimizers(use_pl_optimizer=False).optimizers)
        parts["sparse"].zero_grad()

    def pipelined_training_step(self, dataloader_iter: Any) -> torch.Tensor:
        """One batch through TorchRec's training pipeline (``model.pipeline``), which also steps the optimizers."""
        if self._pipelined is None:
            self._pipelined = PipelinedTraining(self._resolved_pipeline(), self, click_loss, self.hparams.semi_sync_start_step)
        loss, batch = self._pipelined.step(dataloader_iter)
        self._log_training_step(loss, batch)  # with the rates this step trained with, as in the plain loop
        step_lr_schedulers(self, "step")
        return loss

    def on_train_start(self) -> None:
        restore_scheduled_rates(self)  # a resumed run's first step at its scheduled rate, not the first step's
        self._train_loss = RunningMean()
        if self.hparams.compile and not self._first_compiled_step.reported:
            rank_zero_info("model.compile: the dense layers compile during the first training step (tens of seconds)")
            self._first_compiled_step.start()

    def _log_training_step(self, loss: torch.Tensor, batch: CriteoBatch) -> None:
        """``train/loss``: the mean over the steps since the last written one (app/train/log_steps.py)."""
        if (first_step_s := self._first_compiled_step.stop()) is not None:
            rank_zero_info(f"model.compile: first training step, compilation included: {first_step_s:.1f} s")
        self._train_loss.add(loss)
        if not metrics_written_after_this_batch(self.trainer):
            return
        self.log("train/loss", self._train_loss.pop(), prog_bar=True, batch_size=batch.labels.numel())
        if not self.lr_schedule.is_constant:
            self._log_learning_rates()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Lightning restores its loops after this hook: a checkpoint of the other loop keeps its step.
        carry_step_count(checkpoint, self.automatic_optimization)

    def on_validation_start(self) -> None:
        if self._pipelined is not None:
            self._pipelined.pause()  # evaluation must see its own batches through the model's own forward
        self._fused_step_count.hold(self)  # evaluation must not advance Adam's bias correction (app/train/fused_step_count.py)

    def on_validation_end(self) -> None:
        self._fused_step_count.put_back()

    def on_train_end(self) -> None:
        if self._pipelined is not None:
            self._pipelined.stop()
            self._pipelined = None

    def _log_learning_rates(self) -> None:
        # The rates this step trains with: the scheduler has already advanced past the last step.
        parts = dict(self.optimizers(use_pl_optimizer=False).optimizers)
        self.log("train/lr", parts["dense"].param_groups[0]["lr"], batch_size=1)
        if parts["sparse"].param_groups:  # empty when every table is replicated
            self.log("train/lr_embedding", parts["sparse"].param_groups[0]["lr"], batch_size=1)

    def on_train_epoch_end(self) -> None:
        if not self.automatic_optimization:
            step_lr_schedulers(self, "epoch")
        # Rows the data module dropped under data.on_bad_rows = skip: visible next to the loss.
        datamodule = self.trainer.datamodule
        skipped = datamodule.num_bad_rows_skipped if isinstance(datamodule, CriteoDataModule) else 0
        if skipped:
            self.log("data/bad_rows_skipped", float(skipped), rank_zero_only=True, batch_size=1)

    def validation_step(self, batch: CriteoBatch, batch_idx: int) -> None:
        self._evaluate(batch, self.val_metrics, "val")

    def test_step(self, batch: CriteoBatch, batch_idx: int) -> None:
        self._evaluate(batch, self.test_metrics, "test")

    def _evaluate(self, batch: CriteoBatch, metrics: MetricCollection, split: str) -> None:
        valid = batch.valid_rows  # a slice: no host sync
        probabilities = torch.sigmoid(self(batch).float())[valid]  # every rank runs the sharded forward
        # A batch of padding only (a rank's share of the last eval step, app/data/partition.py) has no
        # row to count, and torchmetrics' accuracy cannot reshape an empty batch: leave it out.
        if batch.num_real_rows != 0:
            metrics.update(probabilities, batch.labels[valid].long())
        # Logged as metric objects: Lightning computes them once per epoch, synced across ranks.
        self.log_dict(metrics, on_step=False, on_epoch=True, prog_bar=True, batch_size=batch.labels.numel())
        groups = _eval_groups(self.trainer.datamodule, split)
        if groups is not None:
            group_auc = self.val_gauc if split == "val" else self.test_gauc
            if batch.num_real_rows != 0:  # the rows' groups, looked up by their ids in the split (on the host)
                rows = batch.row_ids[valid].cpu().numpy()
                group_auc.update(probabilities, batch.labels[valid].long(), torch.from_numpy(groups[rows]))
            self.log(f"{split}/gauc", group_auc, on_step=False, on_epoch=True, prog_bar=True, batch_size=batch.labels.numel())

    def predict_step(self, batch: CriteoBatch, batch_idx: int) -> dict[str, torch.Tensor]:
        valid = batch.valid_rows
        return {"row_ids": batch.row_ids[valid], "probabilities": torch.sigmoid(self(batch).float())[valid]}

    def configure_gradient_clipping(
        self, optimizer: Any, gradient_clip_val: float | None = None, gradient_clip_algorithm: str | None = None
    ) -> None:
        """``trainer.gradient_clip_val`` applied to the dense layers only (docs/training.md).

        Tables with a fused optimizer are updated inside backward and have no gradient left to clip;
        a table the planner replicated (data_parallel) does, but clipping it would train it unlike the
        same table sharded, so Lightning's clipping over every group of the optimizer is narrowed to
        the dense layers' part.
        """
        if not gradient_clip_val:  # Lightning calls this hook on every step, clipping or not
            return
        self.clip_gradients(dense_layers_optimizer(optimizer), gradient_clip_val, gradient_clip_algorithm)

    def configure_optimizers(self) -> Any:
        """Everything but the sharded tables, whose optimizer already runs inside the embedding backward,
        and the learning-rate schedule, stepped after every optimizer step."""
        optimizer = build_optimizer(
            self,
            table_prefix="model.sparse_arch.",
            sparse_optimizer=self.hparams.sparse_optimizer,
            sparse_learning_rate=self.hparams.sparse_learning_rate,
            dense_optimizer=self.hparams.dense_optimizer,
            dense_learning_rate=self.hparams.dense_learning_rate,
            sparse_weight_decay=self.hparams.sparse_weight_decay,
            dense_weight_decay=self.hparams.dense_weight_decay,
            dense_weight_decay_mode=self.hparams.dense_weight_decay_mode,
        )
        if self.lr_schedule.is_constant:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": lr_scheduler_config(optimizer, self.lr_schedule)}


def _table_sizes(num_embeddings_per_feature: int | list[int], features: dict[str, Any] | None) -> list[int]:
    """One size per categorical feature: Criteo's 26 (or the first n), or the data schema's."""
    if features is not None and isinstance(num_embeddings_per_feature, int):
        return [num_embeddings_per_feature] * len(features["categorical"])
    return expand_table_sizes(num_embeddings_per_feature, "num_embeddings_per_feature", require_all=False)


def _eval_groups(datamodule: Any, split: str) -> np.ndarray | None:
    """The group id of each row of the split, by row id, where the data has a group column."""
    return datamodule.eval_groups.get(split) if isinstance(datamodule, CriteoDataModule) else None


def _eval_rows(datamodule: Any, split: str) -> int | None:
    """Rows of the split evaluated, where the data module says (CriteoDataModule after its setup)."""
    if not isinstance(datamodule, CriteoDataModule) or split not in datamodule.datasets:
        return None
    return len(datamodule.datasets[split].source)
