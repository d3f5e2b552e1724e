"""configs/demo.yaml on few training rows: fit takes configs/demo_small_data.yaml's settings after the
recipe and says so; a run that sets one of them itself keeps the recipe's; many rows change nothing."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from app.cli import DLRMCLI
from app.data.datamodule import CriteoDataModule
from app.train.module import DLRMModule
from app.train.small_data import parse_choosing_small_data, training_rows

SMALL = yaml.safe_load(Path("configs/demo_small_data.yaml").read_text())
RECIPE = yaml.safe_load(Path("configs/demo.yaml").read_text())


class _Parsed(Exception):
    pass


class ParseOnly(DLRMCLI):
    """The app's command line, stopped once it has parsed (and chosen): no model, data or training."""

    def before_instantiate_classes(self) -> None:
        raise _Parsed(self.config.fit, self.parser)


def demo_fit(*args: str) -> list[str]:
    return ["fit", "--config", "configs/demo.yaml", *args]


@pytest.fixture(scope="module")
def few_rows_cli(rows) -> tuple:
    """The fit config the app's command line chose on 9,999 rows (and what it logged), and its parser."""
    with pytest.raises(_Parsed) as parsed, _logged() as logged:
        ParseOnly(DLRMModule, CriteoDataModule, seed_everything_default=0, auto_configure_optimizers=False,
                  args=demo_fit("--data.train", str(rows / "few.tsv")))  # fmt: skip
    fit, parser = parsed.value.args
    return fit, logged.getvalue(), parser


def parsed_fit(parser, *args: str):
    """The fit config that the command line's parser gives ``--config configs/demo.yaml ARGS``, chosen
    as the command line chooses."""
    return parse_choosing_small_data(parser.parse_args, demo_fit(*args)).fit


@contextmanager
def _logged() -> Iterator[io.StringIO]:
    """What Lightning's rank-zero logger says meanwhile."""
    text, logger = io.StringIO(), logging.getLogger("lightning.pytorch.utilities.rank_zero")
    handler, level = logging.StreamHandler(text), logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield text
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def settings(fit, values: dict) -> dict:
    """``fit``'s values (a parsed config or its YAML) of the settings ``values`` holds (trainer, model, ...)."""
    return {f"{section}.{key}": fit[section][key] for section, keys in values.items() for key in keys}


def expected(values: dict) -> dict:
    return {f"{section}.{key}": value for section, keys in values.items() for key, value in keys.items()}


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> Path:
    """Files of rows that are only counted here (parsing reads no row)."""
    folder = tmp_path_factory.mktemp("small_data")
    row = "\t".join(["1", *["0"] * 13, *["0a"] * 26]) + "\n"  # Criteo's 40 fields
    (folder / "few.tsv").write_text(row * 9_999)  # one below demo.yaml's bound
    (folder / "enough.tsv").write_text(row * 10_000)
    pq.write_table(pa.table({"label": [0, 1] * 2_000}), folder / "few.parquet", row_group_size=1_000)
    return folder


def test_few_training_rows_take_the_small_data_settings_and_say_so(few_rows_cli, rows):
    assert RECIPE["small_data"] == {"below_rows": 10_000, "config": "configs/demo_small_data.yaml"}
    fit, logged, parser = few_rows_cli
    assert settings(fit, SMALL) == expected(SMALL)
    assert [str(path) for path in fit.config] == ["configs/demo.yaml", "configs/demo_small_data.yaml"]
    assert logged == (
        "data.train has 9,999 rows, fewer than small_data.below_rows = 10,000: fit takes the settings of "
        "configs/demo_small_data.yaml after the recipe; keep the recipe's with --small_data.below_rows 0\n"
    )
    # Off as the line says, or with as many rows as the bound: the recipe's own settings, nothing said.
    with _logged() as quiet:
        off = settings(parsed_fit(parser, "--data.train", str(rows / "few.tsv"), "--small_data.below_rows", "0"), SMALL)
        assert off == expected({section: {key: RECIPE[section][key] for key in SMALL[section]} for section in SMALL})
        assert settings(parsed_fit(parser, "--data.train", str(rows / "enough.tsv")), SMALL) == off
    assert quiet.getvalue() == ""
    assert training_rows(fit.data, 10_000) == 9_999
    assert training_rows({"train": str(rows / "few.parquet"), "format": "auto"}, 10_000) == 4_000  # from the footers


def test_print_config_shows_the_settings_chosen(few_rows_cli, rows, capsys):
    with pytest.raises(SystemExit):
        parsed_fit(few_rows_cli[2], "--data.train", str(rows / "few.tsv"), "--print_config")
    shown = yaml.safe_load(capsys.readouterr().out)
    assert settings(shown, SMALL) == expected(SMALL)


def test_a_run_that_sets_a_small_data_setting_itself_keeps_the_recipes_settings(few_rows_cli, rows):
    with _logged() as logged:
        fit = parsed_fit(few_rows_cli[2], "--data.train", str(rows / "few.tsv"), "--data.batch_size", "64")
    assert fit.data.batch_size == 64 and fit.model.second_order is True and fit.trainer.max_epochs == RECIPE["trainer"]["max_epochs"]
    assert [str(path) for path in fit.config] == ["configs/demo.yaml"]
    assert "but the run sets data.batch_size = 64 itself: fit keeps the recipe's settings" in logged.getvalue()
