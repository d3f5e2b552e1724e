"""The project's side commands (``python -m app.data.preprocess``, ``python -m app.data.multi_hot``)
built like ``python -m app``: jsonargparse reads the options from a function's signature and
docstring, so ``--help``, ``--config FILE`` and ``--print_config`` work the same way, and a bad
setting or input file ends the command with one ``error:`` line and exit status 2."""

from __future__ import annotations

import inspect
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from jsonargparse import ActionConfigFile, ArgumentParser

# Errors a user causes with a setting or a file: shown as one line, not a traceback (as app.cli).
USER_ERRORS = (ValueError, FileNotFoundError)


def build_parser(function: Callable[..., Any], prog: str) -> ArgumentParser:
    """A parser whose options are ``function``'s parameters, documented by its docstring."""
    summary = inspect.cleandoc(function.__doc__ or "").split("\n\n")[0]  # the Args: part documents each option
    parser = ArgumentParser(prog=prog, description=summary, default_env=False)
    parser.add_argument("--config", action=ActionConfigFile, help="a YAML file of these options")
    parser.add_function_arguments(function, fail_untyped=True)
    return parser


def run_command(function: Callable[..., Any], prog: str, argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv``) for ``function`` and call it; returns the exit status."""
    parser = build_parser(function, prog)
    config = parser.parse_args(None if argv is None else list(argv))
    options = parser.instantiate_classes(config).as_dict()
    options.pop("config", None)
    options.pop("__path__", None)
    try:
        function(**options)
    except USER_ERRORS as error:  # CriteoFormatError is a ValueError
        if os.environ.get("APP_TRACEBACK"):
            raise
        print(f"error: {error}\n(set APP_TRACEBACK=1 to see the traceback)", file=sys.stderr)
        return 2
    return 0
