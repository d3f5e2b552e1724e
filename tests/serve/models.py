"""Model files for the serving tests: a small DLRM with seeded random weights written as
``python -m app export`` writes them, hashed or with a frequency threshold's vocabulary, and ``predict``'s
arguments for scoring rows with such a file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from app.checkpoint.export import EXPORT_FORMAT, plain_hyper_parameters
from app.checkpoint.serving_runtime import read_tsv_rows
from app.data.datamodule import CriteoDataModule
from app.data.layout import DATA_LAYOUT_KEY
from app.data.parquet.statistics import STATISTICS_KEY
from app.data.preprocess import Vocabulary
from app.data.preprocess.vocabulary import vocabulary_sha256
from app.model.dlrm import build_dlrm, build_dlrm_arguments
from app.train.module import DLRMModule

EMBEDDING_DIM = 8
MODEL_SETTINGS = ["--model.interaction", "dot", "--model.embedding_dim", str(EMBEDDING_DIM), "--model.dense_arch_layer_sizes", "[16, 8]",
                  "--model.over_arch_layer_sizes", "[16, 1]", "--model.first_order", "true", "--model.second_order", "true"]  # fmt: skip


def counted_vocabulary(train: Path, threshold: int) -> Vocabulary:
    """The ids of ``train`` seen at least ``threshold`` times, per feature (what data.frequency_threshold keeps)."""
    _, ids, _ = read_tsv_rows(train)
    kept = []
    for column in ids.numpy().T:
        values, counts = np.unique(column, return_counts=True)
        kept.append(values[counts >= threshold].astype(np.int64))
    return Vocabulary(threshold, kept, vocabulary_sha256(kept))


def write_model_file(
    path: Path, table_sizes: list[int], seed: int, vocabulary: Vocabulary | None = None, data_layout: dict | None = None,
    dense_statistics: dict | None = None, **settings,
) -> Path:
    """A model file as ``python -m app export`` writes it, its weights drawn from ``seed``; with ``data_layout``
    the layout of the data it was trained on (app/data/layout.py; without: Criteo's TSV, as older exports),
    with ``dense_statistics`` standardize's [mean, std] per column."""
    arguments = dict(embedding_dim=EMBEDDING_DIM, num_embeddings_per_feature=table_sizes, dense_arch_layer_sizes=[16, 8],
                     over_arch_layer_sizes=[16, 1], first_order=True, second_order=True,
                     sparse_optimizer="adagrad", sparse_learning_rate=0.03)  # as configs/demo.yaml  # fmt: skip
    module = DLRMModule(**{**arguments, **settings})
    torch.manual_seed(seed)
    model = build_dlrm(**build_dlrm_arguments(dict(module.hparams)), embedding_device="cpu")
    with torch.no_grad():  # TorchRec's default draws are tiny: spread them so that predictions differ row to row
        for name, table in model.named_parameters():
            if "embedding_bags" in name:
                table.normal_(0.0, 0.3)
    contents = {
        "format": EXPORT_FORMAT,
        "pytorch-lightning_version": "2.6.6",
        "hyper_parameters": plain_hyper_parameters(dict(module.hparams), path),
        "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
    }
    data_state = {} if vocabulary is None else {"frequency_threshold": vocabulary.threshold, "vocabulary": vocabulary.to_plain()}
    if data_layout is not None:
        data_state[DATA_LAYOUT_KEY] = data_layout
    if dense_statistics is not None:
        data_state[STATISTICS_KEY] = dense_statistics
    if data_state:
        contents[CriteoDataModule.__name__] = data_state
    torch.save(contents, path)
    return path


def predict_args(rows: Path, model_file: Path, root: Path, threshold: int) -> list[str]:
    """``python -m app predict`` of ``rows`` with ``model_file`` in float32 (the package computes in float32)."""
    return [
        "predict", "--config", "configs/demo.yaml", *MODEL_SETTINGS,
        "--data.train", "null", "--data.val", "null", "--data.test", "null", "--data.predict", str(rows),
        "--data.frequency_threshold", str(threshold), "--data.cache_dir", str(root / "cache"), "--data.cache_workers", "1",
        "--trainer.precision", "32-true", "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
        "--trainer.default_root_dir", str(root), "--prediction_writer.output_dir", str(root), "--ckpt_path", str(model_file),
    ]  # fmt: skip


def written_probabilities(root: Path) -> np.ndarray:
    """predictions.tsv's probabilities in row order (6 decimals: up to 5e-7 from the model's)."""
    lines = (root / "predictions.tsv").read_text().splitlines()[1:]
    return np.array([float(line.split("\t")[1]) for line in lines])
