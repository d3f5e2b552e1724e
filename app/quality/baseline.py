"""The quality bench's bar: a hashed logistic regression, trained by the app's own CLI and strategy.

``python -m app.quality.baseline fit --config FILE`` is ``python -m app fit`` with this module's
:class:`LogisticRegressionModule` in place of the DLRM: the same data module (the same hashing of
ids into the same table sizes, the same dense transform, the same batches), the same TorchRec
strategy (tables sharded by the planner, the embedding optimizer fused into FBGEMM's backward) and
the same metrics (app/train/metrics.py). The quality bench writes its config from the recipe's
(``python -m app.quality``); it runs on its own for a baseline of any data the app reads.

The model is logistic regression over one-hot ids and the dense features: an embedding table per
categorical feature whose row for an id, summed, is that id's weight; a linear layer over the 13
dense features; and a bias. Each hashed id thus gets one weight, which is what a hashed logistic
regression is; nothing interacts.

Why the rows are 4 wide, not 1: FBGEMM's fused embedding kernels take only widths that are
multiples of 4 (TorchRec asserts it when it builds them, on CPU too). An id's weight is the sum of
its row's 4 entries; each entry receives the same gradient (the logit's derivative is 1 for all
four), so Adagrad's accumulators of the four are equal and, with the kernel's rate set to lr / 4,
the sum moves exactly as a one-wide weight under rate lr would (SGD likewise). The function and the
training are a one-weight-per-id logistic regression's; only the initial weight is a sum of 4 of
TorchRec's small uniform draws.
"""

from __future__ import annotations

import atexit
import gc
from typing import Any, Literal

import numpy as np
import torch
from lightning.pytorch import LightningModule
from torch import nn
from torchmetrics import MetricCollection

from app.cli import run_cli
from app.criteo import NUM_DENSE, expand_table_sizes
from app.data.batches import CriteoBatch
from app.model.dlrm import build_embedding_bag_collection
from app.data.datamodule import CriteoDataModule, counted_table_sizes
from app.notices import silence_library_notices
from app.train.host_group import host_process_group
from app.train.log_steps import RunningMean, metrics_written_after_this_batch
from app.train.metrics import GroupAUC, build_eval_metrics, sync_exact_auc_through
from app.train.optimizers import build_optimizer, fuse_sparse_optimizer
from app.train.pipeline import click_loss

# The optimizers that run on both parts: FBGEMM's fused kernels (tables) and torch's (the dense layer).
BaselineOptimizer = Literal["adagrad", "sgd"]
# The tables' parameters, by name: the strategy fuses their optimizer, build_optimizer skips them.
TABLE_PREFIX = "embeddings."
# Entries per id: the narrowest width FBGEMM's fused kernels take (see the module's docstring).
ROW_WIDTH = 4


class LogisticRegressionModule(LightningModule):
    """Hashed logistic regression: one weight per hashed id of each categorical feature (the sum of
    its row in a sum-pooled embedding table), a linear layer over the dense features and a bias;
    binary cross-entropy on the click logit.

    Args:
        num_embeddings_per_feature: rows of each of the 26 tables: the ids' hash buckets (one int
            for all, or 26 ints). Linked from ``data.num_embeddings_per_feature``, as for the DLRM
            (None, its ``auto``: the data module's count, the tables then built in ``setup``).
        optimizer: ``adagrad`` or ``sgd``, for the id weights (fused into the embedding backward by
            FBGEMM) and for the dense weights and bias (torch's) alike.
        learning_rate: the learning rate of both (of each id's weight: the kernel updates each of the
            row's 4 entries at a quarter of it).
        features: the model's inputs, linked from ``data.schema`` as for the DLRM: a weight per id of each
            categorical feature's table (shared tables shared, pooled as the schema says) and one per
            dense column; None: Criteo's 13 dense and 26 categorical features.
    """

    RUN_SETTINGS = frozenset({"learning_rate"})  # a later run may change it; the rest is the model's

    def __init__(
        self,
        num_embeddings_per_feature: int | list[int] | None = 100_000,
        optimizer: BaselineOptimizer = "adagrad",
        learning_rate: float = 0.05,
        features: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if optimizer not in ("adagrad", "sgd"):
            raise ValueError(f"model.optimizer = {optimizer!r} is not one of adagrad, sgd")
        if not learning_rate > 0:
            raise ValueError(f"model.learning_rate = {learning_rate}: must be > 0")
        self.save_hyperparameters()
        self.register_module("embeddings", None)  # its place among the submodules, whenever it is built
        if num_embeddings_per_feature is not None:
            self._build_embeddings(num_embeddings_per_feature)
        self.dense = nn.Linear(NUM_DENSE if features is None else len(features["dense"]), 1)
        # Zero, as logistic regression starts: torch's default init would add a random dense logit of
        # several units on the log1p features (up to ~20) before the first step.
        nn.init.zeros_(self.dense.weight)
        nn.init.zeros_(self.dense.bias)
        self._train_loss = RunningMean()
        self.val_metrics = build_eval_metrics("val/", "exact")
        self.test_metrics = build_eval_metrics("test/", "exact")
        # GAUC where the data has a group column (data.schema.group), as the DLRM's module computes it.
        self.val_gauc, self.test_gauc = GroupAUC(), GroupAUC()

    def _build_embeddings(self, num_embeddings_per_feature: int | list[int]) -> None:
        features = self.hparams.features
        if features is None:
            sizes = expand_table_sizes(num_embeddings_per_feature, "num_embeddings_per_feature")
        else:  # one weight per id whatever dim the schema gives a table
            count = len(features["categorical"])
            sizes = [num_embeddings_per_feature] * count if isinstance(num_embeddings_per_feature, int) else num_embeddings_per_feature
            features = dict(features, categorical=[dict(c, dim=None) for c in features["categorical"]])
        # On the meta device, as the DLRM's: DistributedModelParallel materialises each table on its
        # shard's rank (TorchRec's initialisation: uniform within +-1/sqrt(rows), near zero).
        self.embeddings = build_embedding_bag_collection(ROW_WIDTH, sizes, "meta", features=features)
        fuse_sparse_optimizer(self.embeddings.parameters(), self.hparams.optimizer, self.hparams.learning_rate / ROW_WIDTH)

    def forward(self, batch: CriteoBatch) -> torch.Tensor:
        """Click logits (B,): the sum of the rows' id weights, plus the dense layer (with the bias)."""
        id_weights = self.embeddings(batch.sparse_features).values()  # (B, 26 x ROW_WIDTH), pooled per feature
        return id_weights.sum(dim=1) + self.dense(batch.dense_features).squeeze(-1)

    def setup(self, stage: str) -> None:
        if self.embeddings is None:  # `data.num_embeddings_per_feature: auto`: counted by the data module's setup
            self.hparams.num_embeddings_per_feature = counted_table_sizes(self.trainer)
            self._build_embeddings(self.hparams.num_embeddings_per_feature)
        if stage in ("fit", "validate", "test"):
            # Every rank gathers the exact AUC's predictions through a group that carries host
            # tensors (as the DLRM's metrics; called on every rank: a collective).
            group = host_process_group()
            sync_exact_auc_through(self.val_metrics, group)
            sync_exact_auc_through(self.test_metrics, group)
            if self._eval_groups("test" if stage == "test" else "val") is not None:
                self.val_gauc.process_group = self.test_gauc.process_group = group

    def training_step(self, batch: CriteoBatch, batch_idx: int) -> torch.Tensor:
        loss = click_loss(self(batch), batch)
        self._train_loss.add(loss)
        if metrics_written_after_this_batch(self.trainer):  # app/train/log_steps.py: a log call costs ~1 ms
            self.log("train/loss", self._train_loss.pop(), prog_bar=True, batch_size=batch.labels.numel())
        return loss

    def on_train_start(self) -> None:
        self._train_loss = RunningMean()

    def validation_step(self, batch: CriteoBatch, batch_idx: int) -> None:
        self._evaluate(batch, self.val_metrics, "val")

    def test_step(self, batch: CriteoBatch, batch_idx: int) -> None:
        self._evaluate(batch, self.test_metrics, "test")

    def _evaluate(self, batch: CriteoBatch, metrics: MetricCollection, split: str) -> None:
        valid = batch.valid_rows  # padding rows that even out the ranks' batches are not scored
        probabilities = torch.sigmoid(self(batch).float())[valid]
        metrics.update(probabilities, batch.labels[valid].long())
        self.log_dict(metrics, on_step=False, on_epoch=True, prog_bar=True, batch_size=batch.labels.numel())
        groups = self._eval_groups(split)
        if groups is not None:  # each row's group, looked up by its row id in the split (on the host)
            group_auc = self.val_gauc if split == "val" else self.test_gauc
            rows = batch.row_ids[valid].cpu().numpy()
            group_auc.update(probabilities, batch.labels[valid].long(), torch.from_numpy(groups[rows]))
            self.log(f"{split}/gauc", group_auc, on_step=False, on_epoch=True, prog_bar=True, batch_size=batch.labels.numel())

    def _eval_groups(self, split: str) -> np.ndarray | None:
        """The group id of each row of the split, by row id, where the data has a group column."""
        datamodule = self.trainer.datamodule
        return datamodule.eval_groups.get(split) if isinstance(datamodule, CriteoDataModule) else None

    def configure_optimizers(self) -> Any:
        """The dense layer's optimizer (and that of tables the planner replicated, at the tables' rate);
        the sharded tables' runs inside the embedding backward."""
        name, learning_rate = self.hparams.optimizer, self.hparams.learning_rate
        return build_optimizer(
            self, table_prefix=TABLE_PREFIX, sparse_optimizer=name, sparse_learning_rate=learning_rate / ROW_WIDTH,
            dense_optimizer=name, dense_learning_rate=learning_rate,
        )  # fmt: skip


def baseline_cli(args: list[str] | None = None) -> Any:
    """``python -m app fit|validate|test`` with the logistic regression as the model: the app's CLI
    class (its checkpoint group, callbacks, table sizes linked from the data) and defaults."""
    silence_library_notices()
    return run_cli(LogisticRegressionModule, args)


if __name__ == "__main__":
    atexit.register(gc.freeze)  # as `python -m app` does (app/__main__.py): no last garbage collection at exit
    baseline_cli()
