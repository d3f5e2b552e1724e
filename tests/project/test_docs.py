"""The docs stay true: every command in README.md and docs/*.md parses with today's command line, the
cheap ones run, and every file, module and page they name exists (as litgpt's tests/test_readme.py)."""

from __future__ import annotations

import importlib
import json
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from app.bench.cli import build_parser as bench_parser
from app.bench.cli import expand_presets
from app.cli import cli_main
from app.command import build_parser
from app.data.multi_hot import convert
from app.data.preprocess.cli import preprocess

DOCS = [Path("README.md"), *sorted(Path("docs").glob("*.md"))]
SUBCOMMANDS = ("fit", "validate", "test", "predict")
TIMEOUT_S = 120


def _shell_blocks(doc: Path) -> list[str]:
    return re.findall(r"^```(?:bash|sh|shell)\n(.*?)^```", doc.read_text(), flags=re.M | re.S)


def _commands(doc: Path) -> list[str]:
    """One string per command of the doc's shell blocks, continuation lines joined."""
    commands = []
    for block in _shell_blocks(doc):
        commands += [c.strip() for c in block.replace("\\\n", " ").splitlines() if c.strip() and not c.strip().startswith("#")]
    return commands


def _app_command(command: str) -> tuple[str, list[str]] | None:
    """``(module, args)`` of a ``python -m app...`` command (also under torchrun, srun or env settings)."""
    words = shlex.split(command, comments=True)
    if "-m" not in words[:-1] or not words[words.index("-m") + 1].startswith("app"):
        return None
    at = words.index("-m")
    # Shell variables stand for numbers here (node ranks, node counts).
    args = [re.sub(r"\$\{?\w+\}?", "1", word) for word in words[at + 2 :]]
    return words[at + 1], args


def _distinct_app_commands() -> list[tuple[Path, str]]:
    """Each distinct command once (README.md and a page often show the same one), with the first doc showing it."""
    first: dict[tuple[str, ...], tuple[Path, str]] = {}
    for doc in DOCS:
        for command in _commands(doc):
            parsed = _app_command(command)
            if parsed is not None:
                first.setdefault((parsed[0], *parsed[1]), (doc, command))
    return list(first.values())


APP_COMMANDS = _distinct_app_commands()


def test_the_docs_have_app_commands_to_check():
    assert len(APP_COMMANDS) >= 20
    modules = {_app_command(command)[0] for _, command in APP_COMMANDS}
    assert {"app", "app.bench", "app.data.preprocess", "app.data.multi_hot"} <= modules


def _exit_code(call) -> int:
    try:
        call()
    except SystemExit as exit_info:
        return exit_info.code or 0
    return 0


def _parses(module: str, args: list[str]) -> None:
    """Parse ``args`` as ``python -m module`` would, without running the command."""
    if module == "app" and args[0] in SUBCOMMANDS:
        assert _exit_code(lambda: cli_main([*args, "--print_config"])) == 0
    elif module == "app" and args[0] == "export":
        from app.checkpoint.export import main as export_main

        assert _exit_code(lambda: export_main([*args[1:], "--print_config"])) == 0
    elif module == "app.bench":
        bench_parser().parse_args(expand_presets(args))
    elif module == "app.bench.serve":
        from app.bench.serve import bench_serve

        build_parser(bench_serve, module).parse_args(args)
    elif module == "app.checkpoint.package_size":
        from app.checkpoint.package_size import report_package_sizes

        build_parser(report_package_sizes, module).parse_args(args)
    elif module == "app.bench.quality_guard":
        from app.bench.quality_guard import build_parser as quality_guard_parser

        quality_guard_parser().parse_args(args)
    elif module == "app.bench.gpu_report":
        from app.bench.gpu_report import main as gpu_report_main

        build_parser(gpu_report_main, module).parse_args(args)
    elif module == "app.quality":
        from app.quality.bench import quality_bench

        build_parser(quality_bench, module).parse_args(args)
    elif module in ("app.data.preprocess", "app.preprocess"):
        build_parser(preprocess, module).parse_args(args)
    elif module == "app.data.multi_hot":
        build_parser(convert, module).parse_args(args)
    else:
        raise AssertionError(f"no parse check for python -m {module}")


def _without_users_configs(args: list[str]) -> list[str]:
    """``args`` less ``--config FILE`` pairs naming a user's file (``preprocess.yaml``), not one of ours."""
    kept = []
    for arg in args:
        if kept and kept[-1] == "--config" and not arg.startswith("configs/") and not Path(arg).exists():
            kept.pop()
        else:
            kept.append(arg)
    return kept


@pytest.mark.parametrize(("doc", "command"), APP_COMMANDS, ids=lambda v: str(v)[:80])
def test_every_documented_app_command_parses(doc, command, capsys, monkeypatch):
    module, args = _app_command(command)
    if "--help" in args or "-h" in args:
        return  # run for real below
    monkeypatch.setattr(sys, "argv", ["python -m " + module])
    _parses(module, _without_users_configs([arg for arg in args if arg != "--print_config"]))
    capsys.readouterr()


TORCHRUN_COMMANDS = [(doc, c) for doc in DOCS for c in _commands(doc) if "torchrun" in shlex.split(c, comments=True)]


@pytest.mark.parametrize(("doc", "command"), TORCHRUN_COMMANDS, ids=lambda v: str(v)[:80])
def test_every_documented_torchrun_command_has_options_this_torchrun_takes(doc, command):
    """torchrun's own options (``--shutdown_timeout`` is new in torch 2.13) and the signal names given to
    its agent, as torch's torchrun parses them."""
    from torch.distributed.run import get_args_parser

    words = shlex.split(command, comments=True)
    at = words.index("torchrun")
    settings = dict(word.split("=", 1) for word in words[:at] if "=" in word)
    options = [re.sub(r"\$\{?\w+\}?", "1", word) for word in words[at + 1 : words.index("-m")]]
    get_args_parser().parse_args([*options, "--module", "app"])
    for name in settings.get("TORCHELASTIC_SIGNALS_TO_HANDLE", "").split(","):
        assert not name or hasattr(signal.Signals, name), f"{doc}: {name} is not a signal"


def test_the_docs_show_torchrun_with_the_signal_settings():
    assert any("TORCHELASTIC_SIGNALS_TO_HANDLE" in command for _, command in TORCHRUN_COMMANDS)


CHEAP = [(doc, command) for doc, command in APP_COMMANDS if {"--help", "--print_config"} & set(_app_command(command)[1])]

# Runs each command as `python -m MODULE ARGS` would (runpy, sys.argv), all in one process so that
# torch, TorchRec and Lightning are imported once; prints one result line per command.
_RUN_EACH = """
import contextlib, io, json, runpy, sys
for module, args in json.loads(sys.argv[1]):
    sys.argv, out = [module, *args], io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as exit_info:
            code = exit_info.code or 0
    print(json.dumps({"command": [module, *args], "exit": code, "printed": len(out.getvalue().strip())}))
"""


def test_the_cheap_documented_commands_run():
    commands = [_app_command(command) for _, command in CHEAP]
    done = subprocess.run(
        [sys.executable, "-c", _RUN_EACH, json.dumps(commands)], capture_output=True, text=True, timeout=TIMEOUT_S * 2
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"command"')]
    assert [r["command"] for r in results] == [[module, *args] for module, args in commands], done.stderr[-3000:]
    failed = [r for r in results if r["exit"] != 0 or not r["printed"]]
    assert not failed, f"{failed}\n{done.stderr[-3000:]}"


def test_some_documented_commands_are_cheap_enough_to_run():
    assert len(CHEAP) >= 3


MAKE_COMMANDS = [(doc, c) for doc in DOCS for c in _commands(doc) if c.startswith("make ")]


@pytest.mark.parametrize(("doc", "command"), MAKE_COMMANDS, ids=lambda v: str(v)[:80])
def test_every_documented_make_target_exists(doc, command):
    targets = set(re.findall(r"^([\w-]+):", Path("Makefile").read_text(), flags=re.M))
    named = [word for word in shlex.split(command, comments=True)[1:] if "=" not in word]
    assert set(named) <= targets, f"{doc}: {command}: no such make target {set(named) - targets}"


def _named_paths(text: str) -> set[str]:
    """Repository paths a doc names; not web addresses, and under data/ only files (data/x is also a metric name)."""
    text = re.sub(r"https?://\S+", "", text)
    found = re.findall(r"(?<![\w/.-])(?:app|configs|scripts|tests|docs|data)/[\w./*-]*", text)
    paths = {match.rstrip(".,:;)") for match in found}
    return {path for path in paths if not path.startswith("data/") or Path(path).suffix}


@pytest.mark.parametrize("doc", DOCS, ids=str)
def test_every_repo_path_a_doc_names_exists(doc):
    generated = ("data/sample", "runs/")  # written by make sample / by runs
    missing = []
    for name in sorted(_named_paths(doc.read_text())):
        if name.startswith(generated) or name in ("data/", "docs/", "tests/") or "*" in name:
            continue
        if not Path(name).exists():
            missing.append(name)
    assert not missing, f"{doc} names paths that do not exist: {missing}"


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for name in parts[cut:]:
                target = getattr(target, name)
        except AttributeError:
            return False
        return True
    return False


@pytest.mark.parametrize("doc", DOCS, ids=str)
def test_every_dotted_app_name_a_doc_names_resolves(doc):
    # Not the export file's format tag ("app.export/1"), which is data, not a module.
    names = set(re.findall(r"(?<![\w./])app(?:\.\w+)+(?![\w/])", doc.read_text()))
    assert not [name for name in sorted(names) if not _resolves(name)]


@pytest.mark.parametrize("doc", DOCS, ids=str)
def test_every_relative_link_resolves(doc):
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text())
    broken = [link for link in links if "://" not in link and not (doc.parent / link).exists()]
    assert not broken, f"{doc}: broken links {broken}"


def test_the_readme_is_short():
    assert len(Path("README.md").read_text().splitlines()) <= 200


# Text that tells how the project was developed rather than how to use it: the tracker's issue numbers (an
# upstream reference names its repository, as torchrec#2394 does), work sessions, the machines it was built
# on, and files outside the repository.
DEVELOPMENT_HISTORY = re.compile(
    r"\b(?:this\s+)?issues?\s+#?\d+|(?<![\w/.-])#\d+\b|\bthis issue\b|\bsessions?\b|\bdevice time\b"
    r"|\bour machines?\b|\bproject's (?:development )?machines?\b|\.\./shared|/work/",
    flags=re.I,
)
PRODUCT_TEXT = [
    Path("README.md"),
    *sorted(Path("docs").glob("*.md")),
    *sorted(Path("configs").rglob("*.yaml")),
    *sorted(Path("app").rglob("*.py")),
]


def development_history(path: Path) -> list[str]:
    """``path:line: text`` for each line of the file that speaks of how the project was developed."""
    lines = path.read_text().splitlines()
    return [f"{path}:{n}: {line.strip()}" for n, line in enumerate(lines, 1) if DEVELOPMENT_HISTORY.search(line)]


def test_no_page_config_or_module_speaks_of_how_the_project_was_developed():
    assert len(PRODUCT_TEXT) > 100
    found = [hit for path in PRODUCT_TEXT for hit in development_history(path)]
    assert not found, "development history in product text:\n" + "\n".join(found)


def test_every_page_is_short_enough_to_read():
    long_pages = {str(doc): n for doc in DOCS if (n := len(doc.read_text().splitlines())) > 300}
    assert not long_pages, f"pages over 300 lines: {long_pages}"
    assert len(Path("README.md").read_text().splitlines()) <= 150


# A figure quoted on several pages carries the same marker next to its value everywhere: the page that
# states it with its date, device and command, and every quote of it.
FIGURE = re.compile(r"<!-- figure: (\w+) = ([^>]+?) -->")


def figures(docs: list[Path]) -> dict[str, dict[str, str]]:
    """Per figure name, the value each doc gives it; a doc giving one name two values is an error."""
    found: dict[str, dict[str, str]] = {}
    for doc in docs:
        for name, value in FIGURE.findall(doc.read_text()):
            assert found.setdefault(name, {}).setdefault(str(doc), value) == value, f"{doc}: figure {name} given twice"
    return found


def test_a_figure_quoted_twice_agrees_with_its_source():
    found = figures(DOCS)
    assert {"demo_val_auc", "cpu_bf16_ratio", "h200_ratio"} <= set(found)
    disagree = {name: by_doc for name, by_doc in found.items() if len(set(by_doc.values())) > 1}
    assert not disagree, f"figures quoted with another value than their source's: {disagree}"
    # The README only quotes: each of its figures has a source page under docs/.
    unsourced = [name for name, by_doc in found.items() if set(by_doc) == {"README.md"}]
    assert not unsourced, f"README.md quotes figures no page states: {unsourced}"


@pytest.mark.parametrize("doc", DOCS, ids=str)
def test_a_marked_figure_is_the_value_written_beside_it(doc):
    text = doc.read_text()
    for marker in FIGURE.finditer(text):
        after = text[marker.end() : marker.end() + 400]
        assert marker.group(2) in after, f"{doc}: figure {marker.group(1)} = {marker.group(2)} is not what the text beside it says"
