"""Every stack the Makefile installs pins every package the app imports, and what those need in turn.

Only torch is installed with its dependencies; everything else goes in with ``pip install --no-deps``
(torchrec's wheel declares the CUDA fbgemm-gpu and torchmetrics==1.0.3), so a package missing from a
stack's files is missing from the stack: torchrec 1.5 to 1.7 import iopath at the top of
torchrec/datasets/criteo.py, which the app imports, and only the oldest stack's file named it. The
stacks mirror the Makefile: ``setup`` (requirements.txt and requirements-torchrec.txt; DEVICE=cuda swaps
in requirements-cuda.txt's fbgemm-gpu), and each requirements-compat-NAME.txt over requirements.txt
minus the lines it replaces. What a package requires is read from its metadata in this environment.
"""

from __future__ import annotations

import ast
import functools
import re
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]

# Imported at the top of a torchrec module the app imports, by a supported torchrec that does not
# declare it (1.5 to 1.7, torchrec/datasets/criteo.py line 18: `from iopath.common.file_io import ...`);
# 1.8 and 1.9 import it lazily.
IMPORTED_BY_OLDER_TORCHREC = {"iopath"}

# PyPI's CPU and CUDA builds of FBGEMM: one package, the same modules, under two names.
SAME_PACKAGE = {"fbgemm-gpu": "fbgemm-gpu-cpu"}

_PIN = re.compile(r"^([A-Za-z0-9_.-]+)(?:\[([^\]]*)\])?==")


def pinned(*files: str) -> dict[str, set[str]]:
    """Canonical distribution name -> the extras its pin asks for, over the given requirements files."""
    pins: dict[str, set[str]] = {}
    for file in files:
        for line in (ROOT / file).read_text().splitlines():
            match = _PIN.match(line)
            if match:
                extras = {extra.strip() for extra in (match.group(2) or "").split(",") if extra.strip()}
                pins[canonicalize_name(match.group(1))] = extras
    return pins


def stacks() -> dict[str, dict[str, set[str]]]:
    setup = pinned("requirements.txt", "requirements-torchrec.txt")
    cuda = {name: extras for name, extras in setup.items() if name != "fbgemm-gpu-cpu"} | pinned("requirements-cuda.txt")
    found = {"setup": setup, "setup DEVICE=cuda": cuda}
    for file in sorted(ROOT.glob("requirements-compat-*.txt")):
        # The Makefile's compat rule: requirements.txt without the names the stack's file pins, then its pins.
        found[file.name] = pinned("requirements.txt") | pinned(file.name)
    return found


@functools.cache
def third_party_modules_imported_by_the_app() -> frozenset[str]:
    modules: set[str] = set()
    for path in (ROOT / "app").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                modules |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules.add(node.module.split(".")[0])
    return frozenset(module for module in modules if module != "app" and module not in sys.stdlib_module_names)


@functools.cache
def declared_requirements(distribution: str) -> tuple[Requirement, ...]:
    return tuple(Requirement(line) for line in metadata.requires(distribution) or [])


def requirements_of(distribution: str, extras: set[str]) -> dict[str, set[str]]:
    """The distributions ``distribution[extras]`` declares for this Python, with the extras it asks of them."""
    needed: dict[str, set[str]] = {}
    for requirement in declared_requirements(distribution):
        marker = requirement.marker
        if marker is None or any(marker.evaluate({"extra": extra}) for extra in extras | {""}):
            needed.setdefault(canonicalize_name(requirement.name), set()).update(requirement.extras)
    return needed




def needed_distributions(roots: dict[str, set[str]]) -> set[str]:
    """``roots`` and everything they require, transitively."""
    needed: dict[str, set[str]] = {}
    pending = list(roots.items())
    while pending:
        name, extras = pending.pop()
        name = SAME_PACKAGE.get(name, name)
        if name in needed and extras <= needed[name]:
            continue
        needed.setdefault(name, set()).update(extras)
        pending.extend(requirements_of(name, needed[name]).items())
    return set(needed)


@functools.cache
def distributions_by_module() -> dict[str, list[str]]:
    return metadata.packages_distributions()


def installed_by_torch() -> set[str]:
    """torch's own dependencies, transitively (a CUDA build's nvidia-* libraries and theirs): the
    Makefile installs torch first, with them."""
    return needed_distributions({"torch": set()})


def app_roots(stack: dict[str, set[str]]) -> dict[str, set[str]]:
    """The distributions of the modules the app (and an older torchrec) imports, with the extras the
    stack pins them with (jsonargparse[signatures])."""
    by_module = distributions_by_module()
    roots: dict[str, set[str]] = {}
    for module in sorted(third_party_modules_imported_by_the_app() | IMPORTED_BY_OLDER_TORCHREC):
        assert module in by_module, f"{module}: imported by the app but not installed in this environment"
        for distribution in by_module[module]:
            name = canonicalize_name(distribution)
            roots[name] = set(stack.get(name, set()))
    return roots


@pytest.mark.parametrize("stack_name", list(stacks()))
def test_every_stack_pins_what_the_app_imports_and_what_that_requires(stack_name):
    stack = stacks()[stack_name]
    named = {SAME_PACKAGE.get(name, name) for name in stack}
    missing = needed_distributions(app_roots(stack)) - named - installed_by_torch()
    assert not missing, f"{stack_name}: installs none of {sorted(missing)}"


def test_the_app_imports_the_packages_this_check_is_about():
    # The scan sees the app's own third-party imports and iopath's dependency on portalocker.
    assert {"torch", "torchrec", "fbgemm_gpu", "lightning", "yaml"} <= third_party_modules_imported_by_the_app()
    assert {"iopath", "portalocker", "tqdm", "torchrec", "fbgemm-gpu-cpu"} <= needed_distributions(app_roots({}))
