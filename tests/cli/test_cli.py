"""The command line: every config parses, --help documents, and bad settings stop with one clear line."""

from __future__ import annotations

import os

from pathlib import Path

import pytest

from app.cli import cli_main

CONFIGS = sorted(Path("configs").glob("*.yaml"))


def _run(args: list[str]) -> int:
    """The exit code of ``python -m app ARGS`` (torchelastic's @record turns exit(0) into a return)."""
    try:
        cli_main(args)
    except SystemExit as exit_info:
        return exit_info.code
    return 0


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_every_config_parses(config, capsys):
    configs = ["--config", "configs/demo.yaml"] if config.name.startswith("demo_") else []
    assert _run(["fit", *configs, "--config", str(config), "--print_config"]) == 0
    printed = capsys.readouterr().out
    assert "class_path: app.distributed.strategy.TorchRecStrategy" in printed
    assert "interaction:" in printed


def test_help_lists_the_subcommands(capsys):
    assert _run(["--help"]) == 0
    out = capsys.readouterr().out
    for subcommand in ("fit", "validate", "test", "predict"):
        assert subcommand in out


def test_fit_help_documents_the_arguments(capsys):
    assert _run(["fit", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--model.embedding_dim" in out and "the width of every embedding table" in out
    assert "--data.batch_size" in out and "rows per batch on each process" in out
    assert "--data.train" in out and "a glob, a directory" in out
    assert "--checkpoint.every_n_train_steps" in out and "--checkpoint.save_top_k" in out
    assert "--save_on_signal.signals" in out and "the signals that trigger the save" in out


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_configs_name_no_output_path_but_the_run_folder(config):
    # Loggers and checkpoints follow trainer.default_root_dir, so --trainer.default_root_dir moves all.
    settings = [line.split("#")[0] for line in config.read_text().splitlines()]
    lines = [line for line in settings if "runs/" in line or "save_dir" in line or "dirpath" in line]
    assert all(line.strip().startswith("default_root_dir: runs/") for line in lines), lines


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--trainer.strategy.sharding_types", "[row_wise]"],
            "strategy.sharding_types: 'row_wise' is not available on cpu",
        ),
        (["--trainer.strategy.sharding_types", "[diagonal]"], "strategy.sharding_types: unknown sharding type 'diagonal'"),
        (
            ["--trainer.strategy.table_constraints", "{t_cat_0: {sharding_types: [table_row_wise]}}"],
            "strategy.table_constraints.t_cat_0.sharding_types: 'table_row_wise' is not available on cpu",
        ),
        (["--trainer.strategy.topology", "mi400"], "strategy.topology = 'mi400' is not a preset; choose one of auto, cpu"),
        (["--trainer.strategy.topology", "mi300x"], "strategy.topology = 'mi300x' describes cuda devices but this run"),
        (["--trainer.strategy.topology_overrides", "{hbm_gb: 1}"], "unknown field(s) hbm_gb; valid fields are hbm_cap"),
        (["--trainer.strategy.planner_objective", "speed"], "strategy.planner_objective = 'speed': choose one of"),
        (["--data.num_embeddings_per_feature", "[1, 2, 3]"], "num_embeddings_per_feature has 3 sizes; give 26"),
        (["--data.train", "no/such/file.tsv"], "data.train: data file or directory 'no/such/file.tsv' does not exist"),
        (["--model.dense_arch_layer_sizes", "[64, 8]"], "model.dense_arch_layer_sizes = [64, 8] must end with"),
        (["--trainer.accumulate_grad_batches", "2"], "trainer.accumulate_grad_batches = 2: the embedding optimizer is fused"),
        (["--model.sparse_learning_rate", "-0.05"], "model.sparse_learning_rate = -0.05 must be a number > 0"),
        (["--model.dense_learning_rate", "0"], "model.dense_learning_rate = 0.0 must be a number > 0"),
        (["--model.lr_decay_steps", "10", "--model.lr_decay_power", "-1"], "model.lr_decay_power = -1.0 must be a number > 0"),
        (["--model.sparse_optimizer", "adam"], "model.sparse_optimizer: Adam has no CPU embedding kernel in FBGEMM"),
        (["--model.embedding_precision", "fp16"], "model.embedding_precision = fp16: FBGEMM's CPU embedding kernels round"),
        (
            ["--model.compile", "true", "--model.compile_mode", "reduce-overhead"],
            "model.compile_mode = reduce-overhead replays the dense layers as CUDA graphs, which need a CUDA GPU (here: cpu)",
        ),
        (["--model.compile_mode", "max-autotune"], "model.compile_mode = max-autotune applies to compiled dense layers: set model.compile: true"),
        (["--model.compile", "true", "--model.compile_mode", "fastest"], "model.compile_mode = 'fastest' is not a torch.compile mode"),
    ],
)
def test_bad_settings_stop_before_any_worker_with_one_line(args, message, sample_dir, capsys):
    base = ["fit", "--config", "configs/demo.yaml", "--data.train", str(sample_dir / "train.tsv"), "--data.val", "null"]
    assert _run(base + ["--data.test", "null", "--data.predict", "null", *args]) == 2
    err = capsys.readouterr().err
    assert "error: " in err and message in err
    assert "Traceback" not in err
    # Lightning starts the other ranks by running this process's command again: here, pytest.
    relaunched = [command for command in _child_processes() if "pytest" in command]
    assert relaunched == [], "a worker was started before the setting was refused"


BAD_YAML = {  # a config's text, where the parser stopped (line:column), and a part of its problem
    "tab.yaml": ("trainer:\n\tmax_steps: 3\n", "2:1", "cannot start any token (a tab: YAML indents with spaces)"),
    "unclosed.yaml": ("model:\n  dense_arch_layer_sizes: [64, 16\n", "3:1", "',' or ']'"),
    "tag.yaml": ("model: !!python/object/apply:os.system [echo]\n", "1:8", "could not determine a constructor for the tag"),
    "missing.yaml": (None, None, None),
}


@pytest.mark.parametrize("name", sorted(BAD_YAML))
@pytest.mark.parametrize("command", ["fit", "validate", "predict", "export", "bench", "preprocess"])
def test_a_config_that_is_not_yaml_is_named_with_line_and_column_in_one_line(command, name, tmp_path, capsys):
    from app.bench.cli import main as bench_main
    from app.checkpoint.export import main as export_main
    from app.data.preprocess.cli import main as preprocess_main

    config = tmp_path / name
    text, where, problem = BAD_YAML[name]
    if text is not None:
        config.write_text(text)
    args = ["--config", str(config)]
    commands = {"bench": lambda: bench_main(args), "export": lambda: export_main(args), "preprocess": lambda: preprocess_main(args)}
    with pytest.raises(SystemExit) as exit_info:
        commands.get(command, lambda: cli_main([command, *args]))()
    assert exit_info.value.code == 2
    # One line naming the file, line and column: no usage, no "<unicode string>", no traceback hint.
    err = capsys.readouterr().err.splitlines()
    if text is None:
        assert err == [f"error: --config {config}: no such file"]
    else:
        assert len(err) == 1 and err[0].startswith(f"error: {config}:{where}: ") and problem in err[0], err


def _child_processes() -> list[str]:
    """Command lines of this process's living children (Linux /proc; e.g. multiprocessing's resource
    tracker, which earlier tests leave running)."""
    children = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line)
            if int(fields.get("PPid", "0")) == os.getpid() and not fields.get("State", "").startswith("Z"):
                children.append((status.parent / "cmdline").read_text().replace("\0", " "))
        except (OSError, ValueError):
            continue  # the process ended while being read
    return children


def test_fp16_mixed_precision_is_refused_on_gpus(recwarn):
    # trainer.precision 16-mixed on GPUs: loss scaling would sit between backward and the optimizer
    # step, where the fused embedding update has already happened (docs/training.md). (On CPU Lightning
    # itself turns 16-mixed into bf16-mixed with a warning; 16-true is refused in test_hbm_budget.py.)
    # No GPU here: the strategy's check is given the precision plugin Lightning builds for one.
    from types import SimpleNamespace

    from lightning.pytorch.plugins.precision import MixedPrecision

    from app.distributed.strategy import TorchRecStrategy

    strategy = TorchRecStrategy()
    strategy.precision_plugin = MixedPrecision("16-mixed", "cuda")  # warns here: no CUDA to scale on
    with pytest.raises(ValueError) as refused:
        strategy._reject_settings_fused_updates_cannot_honour(SimpleNamespace(accumulate_grad_batches=1))
    assert str(refused.value) == (
        "trainer.precision = 16-mixed: fp16 loss scaling cannot reach the fused embedding update; use bf16-mixed"
    )
    strategy.precision_plugin = MixedPrecision("bf16-mixed", "cuda")
    strategy._reject_settings_fused_updates_cannot_honour(SimpleNamespace(accumulate_grad_batches=1))  # accepted


@pytest.mark.parametrize(
    ("args", "bar"),
    [
        ([], ("TQDMProgressBar", 20)),
        (["--progress_bar.refresh_rate", "1"], ("TQDMProgressBar", 1)),
        (["--trainer.enable_progress_bar", "false"], None),
        # A bar of the user's own replaces the app's (Lightning refuses two).
        (["--trainer.callbacks+=TQDMProgressBar", "--trainer.callbacks.refresh_rate", "7"], ("TQDMProgressBar", 7)),
    ],
    ids=["default", "refresh_rate", "disabled", "users_own"],
)
def test_the_progress_bar_redraws_every_20_batches_unless_set_otherwise(args, bar, sample_dir, tmp_path):
    from lightning.pytorch.callbacks import ProgressBar

    from app.cli import DLRMCLI
    from app.data.datamodule import CriteoDataModule
    from app.train.module import DLRMModule

    cli = DLRMCLI(
        DLRMModule, CriteoDataModule, run=False, auto_configure_optimizers=False,
        args=[
            "--config", "configs/demo.yaml", "--trainer.default_root_dir", str(tmp_path),
            # The test's own rows: `make test` runs on a clone where `make sample` has not written data/sample/.
            "--data.train", str(sample_dir / "train.tsv"), "--data.val", str(sample_dir / "val.tsv"), *args,
        ],
    )  # fmt: skip
    bars = [c for c in cli.trainer.callbacks if isinstance(c, ProgressBar)]
    assert [(type(c).__name__, c.refresh_rate) for c in bars] == ([bar] if bar else [])
