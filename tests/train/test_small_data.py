"""configs/demo.yaml on few training rows: fit takes configs/demo_small_data.yaml's settings after the
recipe and says so; a run that sets one of them itself keeps the recipe's; many rows change nothing."""

from __future__ import annotations

import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from app.cli import DLRMCLI
from app.data.datamodule import CriteoDataModule
from app.train.module import DLRMModule
from app.train.small_data import training_rows

SMALL = yaml.safe_load(Path("configs/demo_small_data.yaml").read_text())
RECIPE = yaml.safe_load(Path("configs/demo.yaml").read_text())


class _Parsed(Exception):
    pass


class ParseOnly(DLRMCLI):
    """The app's command line, stopped once it has parsed (and chosen): no model, data or training."""

    def before_instantiate_classes(self) -> None:
        raise _Parsed(self.config.fit)


def parsed_fit(*args: str):
    """The fit config parsed (and chosen) from ``--config configs/demo.yaml`` and ``args``."""
    with pytest.raises(_Parsed) as parsed:
        ParseOnly(DLRMModule, CriteoDataModule, seed_everything_default=0, auto_configure_optimizers=False,
                  args=["fit", "--config", "configs/demo.yaml", *args])  # fmt: skip
    return parsed.value.args[0]


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


def test_few_training_rows_take_the_small_data_settings_and_say_so(rows, caplog):
    assert RECIPE["small_data"] == {"below_rows": 10_000, "config": "configs/demo_small_data.yaml"}
    with caplog.at_level(logging.INFO):
        fit = parsed_fit("--data.train", str(rows / "few.tsv"))
    assert settings(fit, SMALL) == expected(SMALL)
    assert [str(path) for path in fit.config] == ["configs/demo.yaml", "configs/demo_small_data.yaml"]
    assert (
        "data.train has 9,999 rows, fewer than small_data.below_rows = 10,000: fit takes the settings of "
        "configs/demo_small_data.yaml after the recipe; keep the recipe's with --small_data.below_rows 0"
    ) in caplog.text
    # Off as the line says, or with as many rows as the bound: the recipe's own settings, nothing said.
    caplog.clear()
    with caplog.at_level(logging.INFO):
        off = settings(parsed_fit("--data.train", str(rows / "few.tsv"), "--small_data.below_rows", "0"), SMALL)
        assert off == expected({section: {key: RECIPE[section][key] for key in SMALL[section]} for section in SMALL})
        assert settings(parsed_fit("--data.train", str(rows / "enough.tsv")), SMALL) == off
    assert "small_data" not in caplog.text
    assert training_rows(fit.data, 10_000) == 9_999
    assert training_rows({"train": str(rows / "few.parquet"), "format": "auto"}, 10_000) == 4_000  # from the footers


def test_print_config_shows_the_settings_chosen(rows, capsys):
    with pytest.raises(SystemExit):
        parsed_fit("--data.train", str(rows / "few.tsv"), "--print_config")
    shown = yaml.safe_load(capsys.readouterr().out)
    assert settings(shown, SMALL) == expected(SMALL)


def test_a_run_that_sets_a_small_data_setting_itself_keeps_the_recipes_settings(rows, caplog):
    with caplog.at_level(logging.INFO):
        fit = parsed_fit("--data.train", str(rows / "few.tsv"), "--data.batch_size", "64")
    assert fit.data.batch_size == 64 and fit.model.second_order is True and fit.trainer.max_epochs == RECIPE["trainer"]["max_epochs"]
    assert [str(path) for path in fit.config] == ["configs/demo.yaml"]
    assert "but the run sets data.batch_size = 64 itself: fit keeps the recipe's settings" in caplog.text
