"""The tree is the architecture (docs/architecture.md): imports go down the layers, never up or sideways,
no module reaches into another package's private names, and every module says what it is for."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from app.moved import MOVED_MODULES, find_moved_name

APP = Path("app")

# Modules that import nothing from app and may be imported from anywhere.
LEAVES = {"app.compat", "app.command", "app.criteo", "app.moved", "app.notices"}
# Lowest first. A unit may import the leaves and the units of lower layers only: not a unit of its own
# layer (model and data know nothing of each other; neither do train and checkpoint), nor a higher one.
LAYERS = [
    ["app.model", "app.data"],
    ["app.train", "app.checkpoint"],
    ["app.distributed"],
    ["app.cli", "app.preprocess", "app.bench"],
    ["app.quality"],  # drives app.cli's commands (the recipe and its baseline)
    ["app.__main__"],
]
LAYER_OF = {unit: index for index, layer in enumerate(LAYERS) for unit in layer}


def _module_name(path: Path) -> str:
    name = ".".join(path.with_suffix("").parts)
    return name.removesuffix(".__init__")


def _unit(module: str) -> str:
    """The package (``app.data``) or top-level module (``app.cli``) a module belongs to."""
    return ".".join(module.split(".")[:2])


def _app_imports(tree: ast.Module) -> list[tuple[str, list[str]]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.split(".")[0] == "app":
            found.append((node.module, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            found.extend((alias.name, []) for alias in node.names if alias.name.split(".")[0] == "app")
    return found


def _is_module(dotted: str) -> bool:
    path = Path(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


SOURCES = sorted(APP.rglob("*.py"))


def test_every_module_belongs_to_a_layer():
    units = {_unit(_module_name(path)) for path in SOURCES} - {"app"}
    assert units <= set(LAYER_OF) | LEAVES, sorted(units - set(LAYER_OF) - LEAVES)


@pytest.mark.parametrize("path", SOURCES, ids=str)
def test_imports_go_down_the_layers(path):
    module = _module_name(path)
    unit = _unit(module)
    for imported, _ in _app_imports(ast.parse(path.read_text())):
        target = _unit(imported)
        if target == unit or target in LEAVES:
            continue
        assert unit not in LEAVES, f"{module} is a leaf but imports {imported}"
        assert target in LAYER_OF, f"{module} imports {imported}, which belongs to no layer"
        assert LAYER_OF[target] < LAYER_OF[unit], (
            f"{module} ({unit}, layer {LAYER_OF[unit]}) imports {imported} ({target}, layer {LAYER_OF[target]}): "
            "imports must go to a lower layer (docs/architecture.md)"
        )


@pytest.mark.parametrize("path", SOURCES, ids=str)
def test_no_module_uses_another_packages_private_names(path):
    module = _module_name(path)
    tree = ast.parse(path.read_text())
    other_modules = {}  # local name -> module of another unit, to catch `other._private`
    for imported, names in _app_imports(tree):
        if _unit(imported) == _unit(module):
            continue
        private = [name for name in names if name.startswith("_")]
        assert not private, f"{module} imports private {private} from {imported}"
        for name in names:
            if _is_module(f"{imported}.{name}"):
                other_modules[name] = f"{imported}.{name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in other_modules:
            assert not node.attr.startswith("_"), f"{module} uses {other_modules[node.value.id]}.{node.attr}"


def _top_level_names(tree: ast.Module) -> set[str]:
    """The names a module binds at its top level by a def, a class or an assignment (not an import)."""
    names = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(name.id for target in targets for name in ast.walk(target) if isinstance(name, ast.Name))
    return names


CRITEO = APP / "criteo.py"
# Names the Criteo counts had in the model before they had one home.
FORMER_CRITEO_NAMES = {"NUM_DENSE_FEATURES", "NUM_SPARSE_FEATURES"}


@pytest.mark.parametrize("path", [path for path in SOURCES if path != CRITEO], ids=str)
def test_the_criteo_counts_and_table_sizes_are_defined_in_app_criteo_only(path):
    # model/ and data/ may not import each other: each once had its own copy of these, and they drifted.
    shared = _top_level_names(ast.parse(CRITEO.read_text())) | FORMER_CRITEO_NAMES
    redefined = sorted(_top_level_names(ast.parse(path.read_text())) & shared)
    assert not redefined, f"{path} defines {redefined}: import them from app.criteo"


@pytest.mark.parametrize("path", SOURCES, ids=str)
def test_every_module_has_a_docstring(path):
    assert ast.get_docstring(ast.parse(path.read_text())), f"{path}: no module docstring"


def test_every_moved_module_exists_at_its_new_place_and_not_at_its_old():
    for old, new in MOVED_MODULES.items():
        assert _is_module(new), new
        if old != "app.preprocess":  # kept as the command's old name (app/preprocess.py)
            assert not _is_module(old), f"{old} still exists beside {new}"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["fit", "--trainer.strategy", "app.strategy.TorchRecStrategy"],
         "command line: app.strategy.TorchRecStrategy moved to app.distributed.strategy.TorchRecStrategy"),
        (["fit", "--trainer.callbacks+=app.health.RankHealth"],
         "command line: app.health.RankHealth moved to app.distributed.health.RankHealth"),
        (["fit", "--trainer.logger", '{"class_path": "app.loggers.RunCSVLogger"}'],
         "app.loggers.RunCSVLogger moved to app.train.loggers.RunCSVLogger"),
    ],
)  # fmt: skip
def test_a_moved_name_on_the_command_line_is_refused_naming_the_new(args, message):
    assert message in find_moved_name(args)


def test_a_moved_name_in_a_config_is_refused_naming_the_file_and_the_new(tmp_path, capsys):
    from app.cli import cli_main

    old = tmp_path / "old.yaml"
    # A comment may still mention an old name; only values count.
    old.write_text(
        Path("configs/demo.yaml").read_text().replace("app.train.loggers.", "app.loggers.")
        + "# python -m app.preprocess --input x --output y\n"
    )
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["fit", "--config", str(old), "--print_config"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {old}: app.loggers.RunCSVLogger moved to app.train.loggers.RunCSVLogger "
                   "(app/ is grouped by concern: docs/architecture.md)"]  # fmt: skip


def test_current_names_and_comments_are_not_flagged():
    assert find_moved_name(["fit", "--config", "configs/kaggle_dlrm.yaml"]) is None  # its comments name app.preprocess
    assert find_moved_name(["--trainer.strategy", "app.distributed.strategy.TorchRecStrategy"]) is None
    assert find_moved_name(["--data.train", "data/app.module/train.tsv"]) is None


def test_the_old_preprocess_command_name_still_runs(capsys, monkeypatch):
    import runpy
    import sys

    monkeypatch.setattr(sys, "argv", ["python -m app.preprocess", "--help"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("app.preprocess", run_name="__main__")  # as `python -m app.preprocess --help`
    assert exit_info.value.code == 0
    assert "--frequency_threshold" in capsys.readouterr().out
    with pytest.raises(AttributeError, match="import Config from app.data.preprocess"):
        import app.preprocess

        app.preprocess.Config  # noqa: B018
