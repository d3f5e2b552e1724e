"""Few training rows: a recipe's settings for small data, chosen by ``fit`` from the row count.

A recipe (``configs/demo.yaml``) names, in its ``small_data`` group, a config for few training rows
(``configs/demo_small_data.yaml``) and the row count below which ``fit`` takes it: the config then
goes right after the recipe on the command line, as if given as
``--config RECIPE --config SMALL_DATA_CONFIG ...``, and the run's saved config.yaml records what was
trained. One line says so, and how to keep the recipe's settings (``--small_data.below_rows 0``).

All or nothing: a run that sets one of that config's settings itself after the recipe (another
config, a flag: ``--data.batch_size 64``) is tuned by hand, and keeps the recipe's other settings too
(a line says which setting decided it); the small-data settings were measured together.

Only raw TSV (plain or gzip) and Parquet training files are counted (TSV up to the bound, Parquet from
its footers); preprocessed days and ``data.split`` are large data by construction.
"""

from __future__ import annotations

import gzip
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import yaml
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from app.data.splits import split_files

SETTING = "small_data.below_rows"
_READ_BYTES = 1 << 20  # read at a time while counting TSV lines


def add_small_data_arguments(parser: Any) -> None:
    """The ``small_data`` group of the command line (shown by ``--help``)."""
    parser.add_argument(
        "--small_data.below_rows", type=int, default=0,
        help="fit: with fewer training rows than this, take small_data.config's settings after the first "
        "--config (the recipe), unless the run sets one of them itself; 0: never",
    )  # fmt: skip
    parser.add_argument("--small_data.config", type=str | None, default=None, help="the config for few training rows")


def parse_choosing_small_data(parse: Callable[[list[str]], Any], words: list[str]) -> Any:
    """The config of the command line ``words`` (``parse`` parses one), with ``small_data.config``'s
    settings after the recipe where a ``fit`` on fewer training rows than ``small_data.below_rows`` takes
    them, saying what it chose; ``--print_config`` prints the config chosen."""
    quiet = [word for word in words if not word.startswith("--print_config")]  # printing ends a parse: choose first
    config = parse(quiet)
    rows_line = few_rows(config)
    final = words
    if rows_line is not None and (where := _after_first_config(quiet)) is not None:
        small_config = config.fit.small_data.config
        with_small = parse(quiet[:where] + ["--config", small_config] + quiet[where:])
        by_hand = settings_set_after(small_config, with_small)
        rank_zero_info(choice_line(rows_line, small_config, by_hand))
        if not by_hand:
            config, where = with_small, _after_first_config(words)
            final = words[:where] + ["--config", small_config] + words[where:]
    return parse(final) if len(quiet) != len(words) else config  # --print_config: prints and exits


def few_rows(config: Any) -> str | None:
    """A line saying that a ``fit`` has fewer training rows than ``small_data.below_rows``; None when not
    (or when the run already gives ``small_data.config``)."""
    if config.get("subcommand") != "fit":
        return None
    fit = config.fit
    below, small_config = fit.small_data.below_rows, fit.small_data.config
    if below < 0:
        raise ValueError(f"{SETTING} = {below}: must be >= 0 (0: never)")
    given = [str(path) for path in fit.get("config") or []]
    if not below or not small_config or any(Path(path).resolve() == Path(small_config).resolve() for path in given):
        return None
    if not Path(small_config).is_file():
        raise FileNotFoundError(f"small_data.config: {small_config} does not exist")
    rows = training_rows(fit.data, below)
    if rows is None or rows >= below:
        return None
    return f"data.train has {rows:,} rows, fewer than {SETTING} = {below:,}"


def choice_line(rows_line: str, small_config: str, by_hand: list[str]) -> str:
    """What fit says it chose: the small-data settings, or the recipe's where the run set one itself."""
    if by_hand:
        return f"{rows_line}, but the run sets {by_hand[0]} itself: fit keeps the recipe's settings, not {small_config}'s"
    return f"{rows_line}: fit takes the settings of {small_config} after the recipe; keep the recipe's with --{SETTING} 0"


def _after_first_config(args: list[str]) -> int | None:
    """The position after the first ``--config FILE`` (or ``--config=FILE``) of ``args``."""
    for index, word in enumerate(args):
        if word == "--config" and index + 1 < len(args):
            return index + 2
        if word.startswith("--config="):
            return index + 1
    return None


def training_rows(data: Any, limit: int) -> int | None:
    """The rows of ``data.train``, counted up to ``limit`` (TSV) or read from the files' footers (Parquet);
    None where not counted (preprocessed days, ``data.split``, files that are not there: the data module
    names those)."""
    if data.get("train") is None or data.get("split") is not None:
        return None
    try:
        files = split_files({"train": data.get("train")}, None, None, data.get("format") or "auto", ["train"])["train"]
    except (ValueError, FileNotFoundError):
        return None
    if files.part != "all":
        return None
    if files.format == "parquet":
        return sum(pq.ParquetFile(path).metadata.num_rows for path in files.files)
    if files.format == "tsv":
        return _lines(files.files, limit)
    return None


def _lines(paths: tuple[Path, ...] | list[Path], limit: int) -> int:
    """Lines of the files, counting stops at ``limit`` (a last line without a newline counts)."""
    total = 0
    for path in paths:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rb") as file:
            last = b"\n"
            while total < limit and (block := file.read(_READ_BYTES)):
                total += block.count(b"\n")
                last = block[-1:]
            total += last != b"\n"
        if total >= limit:
            break
    return total


def settings_set_after(small_config: str, config: Any) -> list[str]:
    """The settings of ``small_config`` whose value in ``config`` (the ``fit`` parsed with it after the
    recipe) is another: set by the run itself after the recipe."""
    leaves = _leaves(yaml.safe_load(Path(small_config).read_text()) or {})
    return [f"{key} = {config.fit[key]!r}" for key, value in leaves.items() if config.fit.get(key) != value]


def _leaves(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict) and value:
            flat.update(_leaves(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
