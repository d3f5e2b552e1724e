"""Command line: ``python -m app fit|validate|test|predict --config FILE [--section.key value ...]``.

Examples::

    python -m app fit --config configs/demo.yaml
    python -m app fit --config configs/demo.yaml --trainer.max_epochs 1 --data.batch_size 1024
    python -m app fit --config configs/demo.yaml --print_config
    torchrun --nnodes 2 --nproc_per_node 8 --node_rank R --master_addr HOST -m app fit --config FILE
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

from lightning.pytorch.cli import LightningCLI
from torch.distributed.elastic.multiprocessing.errors import record

from app.callbacks import PredictionWriter, SamplesPerSecond
from app.data.datamodule import CriteoDataModule
from app.health import RankHealth
from app.module import DLRMModule

# Errors a user causes with a setting or a file: shown as one line, not a traceback.
_USER_ERRORS = (ValueError, FileNotFoundError)


class DLRMCLI(LightningCLI):
    """LightningCLI with the table sizes shared by data and model, and the app's callbacks always on."""

    def add_arguments_to_parser(self, parser) -> None:
        # The data hashes ids modulo the table sizes, so the model's tables must have exactly these sizes.
        parser.link_arguments("data.num_embeddings_per_feature", "model.num_embeddings_per_feature")
        parser.add_lightning_class_args(SamplesPerSecond, "throughput")
        parser.add_lightning_class_args(PredictionWriter, "prediction_writer")
        parser.add_lightning_class_args(RankHealth, "rank_health")


def _silence_known_library_noise() -> None:
    """Deprecation notices from the pinned libraries' internals, which no user setting can change."""
    warnings.filterwarnings("ignore", message="`broadcast_buffers` is deprecated", category=FutureWarning)
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)


@record  # under torchrun, the failing rank's traceback is reported instead of a bare exit code
def cli_main(args: list[str] | None = None) -> DLRMCLI:
    """Parses ``args`` (default: ``sys.argv``), builds the model, data and trainer, and runs the subcommand."""
    _silence_known_library_noise()
    try:
        return DLRMCLI(
            DLRMModule,
            CriteoDataModule,
            trainer_defaults={
                "strategy": {"class_path": "app.strategy.TorchRecStrategy"},
                "default_root_dir": "runs",
            },
            seed_everything_default=0,
            save_config_kwargs={"overwrite": True},
            auto_configure_optimizers=False,
            args=args,
        )
    except _USER_ERRORS as error:
        if os.environ.get("APP_TRACEBACK"):
            raise
        print(f"error: {error}\n(set APP_TRACEBACK=1 to see the traceback)", file=sys.stderr)
        raise SystemExit(2) from None
