"""Command line: ``python -m app fit|validate|test|predict --config FILE [--section.key value ...]``.

Examples::

    python -m app fit --config configs/demo.yaml
    python -m app fit --config configs/demo.yaml --trainer.max_epochs 1 --data.batch_size 1024
    python -m app fit --config configs/demo.yaml --print_config
    python -m app fit --config configs/demo.yaml --early_stopping.monitor val/auc --early_stopping.mode max
    python -m app validate --config configs/demo.yaml --ckpt_path best
    torchrun --nnodes 2 --nproc_per_node 8 --node_rank R --master_addr HOST -m app fit --config FILE
"""

from __future__ import annotations

import inspect
import os
import sys
from typing import Any

from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar, TQDMProgressBar
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.distributed.elastic.multiprocessing.errors import record

from app.checkpoint.best import BEST, find_best_checkpoint
from app.checkpoint.preemption import SaveOnSignal
from app.checkpoint.run_checkpoint import RunCheckpoint
from app.checkpoint.run_folder import LAST, checkpoint_run_folder, fit_run_folder, last_checkpoint
from app.checkpoint.saved_model import SavedModel, check_same_features, read_saved_model, settings_from_checkpoint
from app.command import exit_on_bad_config_files
from app.data.datamodule import CriteoDataModule
from app.distributed.health import RankHealth
from app.distributed.strategy import TorchRecStrategy
from app.moved import find_moved_name
from app.notices import silence_library_notices
from app.train.callbacks import PredictionWriter, SamplesPerSecond
from app.train.early_stopping import EarlyStoppingWhenAsked
from app.train.module import DLRMModule
from app.train.small_data import add_small_data_arguments, parse_choosing_small_data
from app.train.precision import FLOAT32, default_precision

# Errors a user causes with a setting or a file: shown as one line, not a traceback.
_USER_ERRORS = (ValueError, FileNotFoundError)
# Lightning's progress bar redraws at every batch by default (refresh_rate 1): about 0.4 ms a step here
# (docs/performance.md#what-lightning-costs-per-step), several % of a host-bound GPU step, and a line a
# step in a batch job's log. Lightning itself takes 20 on Colab.
PROGRESS_BAR_REFRESH_STEPS = 20


class DLRMCLI(LightningCLI):
    """LightningCLI with the table sizes shared by data and model, and the app's callbacks always on.

    A run owns ``trainer.default_root_dir``: loggers without a ``save_dir`` and the checkpoint group
    without a ``dirpath`` write under it (``checkpoints/``), so that one flag moves everything.
    """

    saved_model: SavedModel | None = None  # what --ckpt_path holds, read once (before_instantiate_classes)

    def add_arguments_to_parser(self, parser) -> None:
        # The data hashes ids modulo the table sizes, so the model's tables must have exactly these sizes;
        # taken from the data module once it exists (`auto` reads them from the data).
        parser.link_arguments("data.model_table_sizes", "model.num_embeddings_per_feature", apply_on="instantiate")
        # The model takes exactly the features the data schema names (its tables, dims and pooling).
        parser.link_arguments("data.model_features", "model.features", apply_on="instantiate")
        parser.add_lightning_class_args(SamplesPerSecond, "throughput")
        parser.add_lightning_class_args(PredictionWriter, "prediction_writer")
        parser.add_lightning_class_args(RankHealth, "rank_health")
        # Checkpointing on by default, as its own group; off with --trainer.enable_checkpointing false.
        parser.add_lightning_class_args(RunCheckpoint, "checkpoint")  # ModelCheckpoint, last.ckpt where fit ended
        parser.set_defaults({"checkpoint.save_last": True})
        parser.add_lightning_class_args(SaveOnSignal, "save_on_signal")
        # Lightning's bar, redrawn every PROGRESS_BAR_REFRESH_STEPS batches; off with --trainer.enable_progress_bar
        # false, and left out when --trainer.callbacks brings a progress bar of its own.
        parser.add_lightning_class_args(TQDMProgressBar, "progress_bar")
        parser.set_defaults({"progress_bar.refresh_rate": PROGRESS_BAR_REFRESH_STEPS})
        # Off unless --early_stopping.monitor names a metric (app/train/early_stopping.py).
        parser.add_lightning_class_args(EarlyStoppingWhenAsked, "early_stopping")
        # Say why fit ended (Lightning prints nothing when it stops early), once, not once per rank.
        parser.set_defaults({"early_stopping.verbose": True, "early_stopping.log_rank_zero_only": True})
        add_small_data_arguments(parser)  # a recipe's settings for few training rows (app/train/small_data.py)

    def parse_arguments(self, parser, args) -> None:
        if args is not None and not isinstance(args, list):
            return super().parse_arguments(parser, args)  # a parsed config (a Python caller): nothing to choose
        # A fit on few rows takes the recipe's small-data config, as if given after the recipe (app/train/small_data.py).
        self.config = parse_choosing_small_data(parser.parse_args, list(sys.argv[1:] if args is None else args))

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        if self.subcommand == "fit":  # runs never mix in one folder: maybe <root>-2 (app/checkpoint/run_folder.py)
            root, saves = config.trainer.default_root_dir or os.getcwd(), config.trainer.get("enable_checkpointing") is not False
            config.trainer.default_root_dir = fit_run_folder(root, config.checkpoint.dirpath, config.get("ckpt_path"), saves)
        # Lightning's own default for an unset default_root_dir: the working directory.
        root = config.trainer.default_root_dir or os.getcwd()
        if config.checkpoint.dirpath is None:
            # Not Lightning's default (the first logger's version folder): a fixed folder per run, so
            # that `--ckpt_path last` finds the run's checkpoints whatever the logger version.
            config.checkpoint.dirpath = os.path.join(root, "checkpoints")
        for logger in _as_list(config.trainer.logger):
            init_args = getattr(logger, "init_args", None)
            if init_args is not None and "save_dir" in init_args and init_args.save_dir is None:
                init_args.save_dir = root
        _choose_precision(config.trainer)
        _check_early_stopping(config)
        if config.get("ckpt_path") == LAST:
            config.ckpt_path = last_checkpoint(config.checkpoint.dirpath, fitting=self.subcommand == "fit")
        if config.get("ckpt_path") == BEST:
            config.ckpt_path = _best_checkpoint_path(config)
        if self.subcommand == "predict" and config.prediction_writer.output_dir is None:
            config.prediction_writer.output_dir = checkpoint_run_folder(config.get("ckpt_path"))  # the checkpoint's run
        self.saved_model = self._take_model_from_checkpoint(config)

    def _parse_ckpt_path(self) -> None:
        """Lightning's version reads an exported file's hyper-parameters into the model's settings, before
        the table sizes are linked over them from the data; :meth:`_take_model_from_checkpoint` does it
        for checkpoint folders and exported files alike, with the sizes and the vocabulary."""

    def _take_model_from_checkpoint(self, config: Any) -> SavedModel | None:
        """The model ``--ckpt_path`` holds, its settings taken into this run's (a contradicting one refused),
        so that no stage reads the training data to rebuild what the checkpoint carries."""
        path = config.get("ckpt_path")  # `last` and `best` resolved to paths by now
        if path is None:
            return None
        saved = read_saved_model(path)
        taken = settings_from_checkpoint(
            saved,
            model=config.model.as_dict(), model_defaults=_init_defaults(self.model_class),
            data=config.data.as_dict(), data_defaults=_init_defaults(self.datamodule_class),
            run_settings=self.model_class.RUN_SETTINGS,
        )
        for key, value in taken.model.items():
            config.model[key] = value
        for key, value in taken.data.items():
            config.data[key] = value
        if taken.taken:
            rank_zero_info(f"ckpt_path {path}: the model's settings as saved: {'; '.join(taken.taken)}")
        return saved

    def instantiate_classes(self) -> None:
        super().instantiate_classes()
        self._hand_over_checkpoint()
        # Before Lightning starts the other ranks: a refused setting or a missing file then costs no
        # launch, and leaves no worker behind.
        if isinstance(self.trainer.strategy, TorchRecStrategy):
            self.trainer.strategy.check_before_launch(self.trainer, self.model)
        if isinstance(self.model, DLRMModule):
            self.model.check_before_launch(self.trainer.strategy.root_device.type, self.subcommand)
        if self.subcommand and self.trainer.global_rank == 0 and isinstance(self.datamodule, CriteoDataModule):
            self.datamodule.check_inputs(self.subcommand)
        # Pre-emption signals are recorded from here on, in every process (each rank runs this CLI), before
        # any work (the raw-TSV conversion in the data module's setup) and before Lightning installs its own handlers. After the
        # checks above: a refused setting leaves the process's handlers as they were.
        for callback in self.trainer.callbacks:
            if isinstance(callback, SaveOnSignal):
                callback.install(self.trainer)

    def _hand_over_checkpoint(self) -> None:
        """The checkpoint read once: its vocabulary maps every split from the data module's setup on (no
        recount), and the strategy plans and loads from its metadata without reading it again."""
        saved = self.saved_model
        if saved is None:
            return
        if isinstance(self.model, DLRMModule):
            check_same_features(saved, self.model.hparams.features)
        if saved.data_state and isinstance(self.datamodule, CriteoDataModule):
            self.datamodule.load_state_dict(saved.data_state)
        if saved.info is not None and isinstance(self.trainer.strategy, TorchRecStrategy):
            self.trainer.strategy.use_checkpoint_info(saved.path, saved.info)

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Callback]) -> Trainer:
        if config.get("enable_checkpointing") is False:
            callbacks = [c for c in callbacks if not isinstance(c, ModelCheckpoint)]
        callbacks = [c for c in callbacks if not isinstance(c, EarlyStoppingWhenAsked) or c.enabled]
        bar_off = config.get("enable_progress_bar") is False
        if bar_off or any(isinstance(c, ProgressBar) for c in _as_list(config.get("callbacks"))):
            callbacks = [c for c in callbacks if not isinstance(c, ProgressBar)]  # Lightning refuses a bar then, or two bars
        trainer = super()._instantiate_trainer(config, callbacks)
        if self.subcommand and hasattr(trainer.strategy, "requested_ckpt_path"):
            trainer.strategy.requested_ckpt_path = self.config_init[self.subcommand].get("ckpt_path")
        return trainer


def _as_list(setting: Any) -> list[Any]:
    """A trainer setting that takes None, one item or a list (``callbacks``, ``logger``), as a list."""
    return [] if setting is None else setting if isinstance(setting, list) else [setting]


def _init_defaults(cls: type) -> dict[str, Any]:
    """The default of each ``__init__`` argument of ``cls``: what a setting is when not given."""
    parameters = inspect.signature(cls.__init__).parameters.values()
    return {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}


def _choose_precision(trainer: Any) -> None:
    """Sets an unset ``trainer.precision`` to the app's default for the accelerator (app/train/precision.py:
    bf16 autocast on a CPU with bf16 matrix units), and says so once. The saved config.yaml then records it."""
    if trainer.get("precision") is not None:
        return
    precision, why = default_precision(trainer.get("accelerator"))
    trainer.precision = precision
    rank_zero_info(f"trainer.precision unset: {precision or FLOAT32} ({why})")


def _check_early_stopping(config: Any) -> None:
    """Refuses an early-stopping group that would stop on the wrong side of the metric it shares with the
    checkpoint group (the mode is Lightning's "min" unless set, and val/auc rises)."""
    stopping, checkpoint = config.early_stopping, config.checkpoint
    if stopping.monitor is not None and stopping.monitor == checkpoint.monitor and stopping.mode != checkpoint.mode:
        raise ValueError(
            f"early_stopping.mode = {stopping.mode} but checkpoint.mode = {checkpoint.mode} for the same metric "
            f"{stopping.monitor}: set --early_stopping.mode {checkpoint.mode}"
        )


def _best_checkpoint_path(config: Any) -> str:
    """``--ckpt_path best`` as a path, read from the checkpoint folder's files: Lightning's own ``best``
    is known only in the process that ran fit. Every process that parses the command line (each rank
    under Lightning's launcher or torchrun) reads the same files and gets the same path, and a refusal
    comes before any worker starts."""
    checkpoint = config.checkpoint
    if checkpoint.monitor is None:
        raise ValueError(
            "ckpt_path best: checkpoint.monitor is not set, so no checkpoint was ranked best; set it as in the "
            "run that wrote them (e.g. --checkpoint.monitor val/auc --checkpoint.mode max) or give a checkpoint path"
        )
    best = find_best_checkpoint(checkpoint.dirpath, checkpoint.monitor, checkpoint.mode)
    rank_zero_info(best.describe())
    return str(best.path)


@record  # under torchrun, the failing rank's traceback is reported instead of a bare exit code
def cli_main(args: list[str] | None = None) -> DLRMCLI:
    """Parses ``args`` (default: ``sys.argv``), builds the model, data and trainer, and runs the subcommand."""
    silence_library_notices()
    moved = find_moved_name(sys.argv[1:] if args is None else args)
    if moved is not None:
        print(f"error: {moved}", file=sys.stderr)
        raise SystemExit(2)
    return run_cli(DLRMModule, args)


def run_cli(model_class: type, args: list[str] | None = None) -> DLRMCLI:
    """``DLRMCLI`` with ``model_class`` as the model (the DLRM, or the quality bench's baseline: each names its
    ``RUN_SETTINGS``, the hyper-parameters a later run may change without changing the model) and the app's
    defaults; a bad setting or file ends the command with one ``error:`` line and exit status 2."""
    exit_on_bad_config_files(sys.argv[1:] if args is None else args)  # a YAML error names its file, line, column
    try:
        return DLRMCLI(
            model_class,
            CriteoDataModule,
            trainer_defaults={
                "strategy": {"class_path": "app.distributed.strategy.TorchRecStrategy"},
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
