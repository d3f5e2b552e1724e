"""The project's side commands (``python -m app.data.preprocess``, ``python -m app.data.multi_hot``)
built like ``python -m app``: jsonargparse reads the options from a function's signature and
docstring, so ``--help``, ``--config FILE`` and ``--print_config`` work the same way, and a bad
setting or input file ends the command with one ``error:`` line and exit status 2."""

from __future__ import annotations

import inspect
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml
from jsonargparse import ActionConfigFile, ArgumentParser, get_loader

# Errors a user causes with a setting or a file: shown as one line, not a traceback (as app.cli).
USER_ERRORS = (ValueError, FileNotFoundError)


def build_parser(function: Callable[..., Any], prog: str) -> ArgumentParser:
    """A parser whose options are ``function``'s parameters, documented by its docstring."""
    summary = inspect.cleandoc(function.__doc__ or "").split("\n\n")[0]  # the Args: part documents each option
    parser = ArgumentParser(prog=prog, description=summary, default_env=False)
    parser.add_argument("--config", action=ActionConfigFile, help="a YAML file of these options")
    parser.add_function_arguments(function, fail_untyped=True)
    return parser


def check_config_files(args: Sequence[str]) -> None:
    """Reads every ``--config FILE`` in ``args`` as jsonargparse will, first: a file that does not exist
    raises FileNotFoundError, one that is not YAML a ValueError naming ``FILE:LINE:COLUMN`` and the parser's
    problem. jsonargparse reports either after its whole usage, a YAML error without the file's name
    ("in <unicode string>"). A ``--config`` given as YAML text, not a path, is left to jsonargparse."""
    for path in _config_arguments(args):
        if not Path(path).is_file():
            if isinstance(_yaml_or_none(path), str):  # a path, not YAML text (jsonargparse's own rule)
                raise FileNotFoundError(f"--config {path}: {'not a file' if Path(path).exists() else 'no such file'}")
            continue
        try:
            text = Path(path).read_text(encoding="utf-8")
            get_loader("yaml")(text)
        except UnicodeDecodeError as error:
            raise ValueError(f"{path}: not a YAML file (byte {error.start} is not UTF-8 text)") from None
        except yaml.MarkedYAMLError as error:
            raise ValueError(_yaml_error_line(path, text, error)) from None
        except yaml.YAMLError as error:
            raise ValueError(f"{path}: {error}") from None


def _yaml_error_line(path: str, text: str, error: yaml.MarkedYAMLError) -> str:
    mark = error.problem_mark or error.context_mark
    if mark is None:
        return f"{path}: {error.problem or error.context}"
    line = text.splitlines()[mark.line] if mark.line < len(text.splitlines()) else ""
    hint = " (a tab: YAML indents with spaces)" if line[mark.column : mark.column + 1] == "\t" else ""
    return f"{path}:{mark.line + 1}:{mark.column + 1}: {error.problem or error.context}{hint}"


def exit_on_bad_config_files(args: Sequence[str]) -> None:
    """``check_config_files``, its error printed as one ``error:`` line, exit status 2 (nothing to trace)."""
    try:
        check_config_files(args)
    except USER_ERRORS as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


def _config_arguments(args: Sequence[str]) -> list[str]:
    found = []
    for index, arg in enumerate(args):
        if arg == "--config" and index + 1 < len(args):
            found.append(args[index + 1])
        elif arg.startswith("--config="):
            found.append(arg.removeprefix("--config="))
    return found


def _yaml_or_none(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return None


def run_command(function: Callable[..., Any], prog: str, argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv``) for ``function`` and call it; returns the exit status."""
    args = sys.argv[1:] if argv is None else list(argv)
    exit_on_bad_config_files(args)
    parser = build_parser(function, prog)
    config = parser.parse_args(args)
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
