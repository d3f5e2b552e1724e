"""Names that moved when ``app/`` was grouped by concern: a command line or config naming an old
module or class is refused with one line naming the new one.

The old names are not kept as aliases: one name per class keeps configs, logs and saved
``config.yaml`` files greppable, and the message tells a user exactly what to write instead.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

# Old module -> new module. ``app.checkpoint`` is left out: it is now the checkpoint package, and none
# of the old module's classes could be named in a config. ``python -m app.preprocess`` still works
# (app/preprocess.py), but as a command only: config values naming its classes are refused too.
MOVED_MODULES = {
    "app.module": "app.train.module",
    "app.pipeline": "app.train.pipeline",
    "app.optimizers": "app.train.optimizers",
    "app.lr_schedule": "app.train.lr_schedule",
    "app.metrics": "app.train.metrics",
    "app.log_steps": "app.train.log_steps",
    "app.callbacks": "app.train.callbacks",
    "app.loggers": "app.train.loggers",
    "app.strategy": "app.distributed.strategy",
    "app.sharding": "app.distributed.sharding",
    "app.plan_report": "app.distributed.plan_report",
    "app.topology": "app.distributed.topology",
    "app.rendezvous": "app.distributed.rendezvous",
    "app.launch": "app.distributed.launch",
    "app.threads": "app.distributed.threads",
    "app.health": "app.distributed.health",
    "app.reshard": "app.checkpoint.reshard",
    "app.export": "app.checkpoint.export",
    "app.preemption": "app.checkpoint.preemption",
    "app.plan_json": "app.checkpoint.plan_json",
    "app.preprocess": "app.data.preprocess",
}

_OLD_NAME = re.compile(
    r"(?<![\w./])(" + "|".join(re.escape(old) for old in sorted(MOVED_MODULES, key=len, reverse=True)) + r")((?:\.\w+)*)(?![\w./])"
)


def moved_name(text: str) -> tuple[str, str] | None:
    """``(old, new)`` for the first moved dotted name in ``text``, e.g. a ``class_path``; else None."""
    match = _OLD_NAME.search(text)
    if match is None:
        return None
    old_module, rest = match.group(1), match.group(2)
    return old_module + rest, MOVED_MODULES[old_module] + rest


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(key)
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def _config_values(path: str) -> list[str]:
    """The strings among a config file's YAML values (keys included); a comment is no value."""
    config = Path(path)
    if not config.is_file():
        return [path]  # --config also takes inline YAML
    try:
        return list(_strings(yaml.safe_load(config.read_text())))
    except (OSError, yaml.YAMLError):
        return []  # the CLI itself reports a config it cannot read


def _named_values(args: Sequence[str]) -> Iterator[tuple[str, str]]:
    """``(where, value)``: every value of every ``--config`` file, and every other argument."""
    config_next = False
    for arg in args:
        if arg == "--config":
            config_next = True
            continue
        config = arg.split("=", 1)[1] if arg.startswith("--config=") else arg if config_next else None
        config_next = False
        if config is None:
            yield "command line", arg
        else:
            yield from ((config, value) for value in _config_values(config))


def find_moved_name(args: Sequence[str]) -> str | None:
    """A one-line message for the first moved name in ``args`` or the configs they name, else None."""
    for where, value in _named_values(args):
        found = moved_name(value)
        if found is not None:
            old, new = found
            return f"{where}: {old} moved to {new} (app/ is grouped by concern: docs/architecture.md)"
    return None
