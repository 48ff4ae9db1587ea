"""The layering, read from every module's imports with ``ast``.

    odb_core  <-  odb_torch  <-  odb_tools          model_checks  ->  odb_core

* ``odb_core`` (the sans-IO protocol) imports no other package of this project;
* ``odb_torch`` (what runs in training) imports ``odb_core`` only: not the tools, the
  demo, nor ``model_checks``;
* ``model_checks`` (TLC, seeded bugs, conformance, trace validation) imports ``odb_core``
  only: it validates real runs from their trace files, never through ``odb_torch``;
* ``odb_tools`` (the ``odb`` command, demo, benchmarks, profile) may import all of them.

No package imports ``tests``, ``benchmarks``, ``docs``, ``scripts`` or ``spec``. Every
import counts: at module level, inside functions, under ``TYPE_CHECKING``, relative ones
(resolved) and ``importlib.import_module``/``__import__`` of a literal name.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("odb_core", "odb_torch", "odb_tools", "model_checks")
NOT_PACKAGES = ("tests", "benchmarks", "docs", "scripts", "spec")
ALLOWED: dict[str, frozenset[str]] = {
    "odb_core": frozenset({"odb_core"}),
    "odb_torch": frozenset({"odb_torch", "odb_core"}),
    "model_checks": frozenset({"model_checks", "odb_core"}),
    "odb_tools": frozenset(PACKAGES),
}
assert set(ALLOWED) == set(PACKAGES)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``source``, the module ``module``."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                if node.level - 1 >= len(package):
                    raise ValueError(f"{module}:{node.lineno}: relative import beyond the top package")
                base = package[: len(package) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.append((node.lineno, name))
            found += [(node.lineno, f"{name}.{alias.name}") for alias in node.names if alias.name != "*"]
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name) and node.func.id in ("import_module", "__import__")))):
            found.append((node.lineno, node.args[0].value))
    return found


def violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """Imports of ``module`` that break the layering, as ``module:line imports name``."""
    layer = module.split(".")[0]
    allowed = ALLOWED[layer]
    out = []
    for line, name in imports(source, module, is_package):
        top = name.split(".")[0]
        if (top in PACKAGES and top not in allowed) or top in NOT_PACKAGES:
            out.append(f"{module}:{line} imports {name}")
    return out


FILES = sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def test_every_package_has_modules() -> None:
    for pkg in PACKAGES:
        mods = [f for f in FILES if f.relative_to(ROOT).parts[0] == pkg]
        assert (ROOT / pkg / "__init__.py") in mods, pkg
        assert len(mods) >= 2, pkg


@pytest.mark.parametrize("path", FILES, ids=[module_name(p) for p in FILES])
def test_import_direction(path: Path) -> None:
    assert violations(path.read_text(encoding="utf-8"), module_name(path), path.name == "__init__.py") == []


def test_tools_are_not_in_the_training_package() -> None:
    moved = ["cli.py", "bench_batching.py", "reference_alignment.py", "baselines.py", "profile.py", "demo"]
    assert [m for m in moved if (ROOT / "odb_torch" / m).exists()] == []
    assert all((ROOT / "odb_tools" / m).exists() for m in moved)


# ---- the check can fail -------------------------------------------------------------

@pytest.mark.parametrize(("module", "source", "is_package", "bad"), [
    ("odb_torch.collate", "def f():\n    from odb_tools.demo.chat_data import tokenizer\n", False,
     ["odb_torch.collate:2 imports odb_tools.demo.chat_data", "odb_torch.collate:2 imports odb_tools.demo.chat_data.tokenizer"]),
    ("odb_torch.windows", "import model_checks.report as r\n", False, ["odb_torch.windows:1 imports model_checks.report"]),
    ("odb_torch.integrations.hf", "from ... import odb_tools\n", False, None),  # beyond the top: an error
    ("odb_torch.integrations.hf", "from .. import loader\nfrom ..windows import x\n", False, []),
    ("odb_core.epoch", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import odb_torch.loader\n", False,
     ["odb_core.epoch:3 imports odb_torch.loader"]),
    ("odb_core.sampler", "from model_checks import mutants\n", False,
     ["odb_core.sampler:1 imports model_checks", "odb_core.sampler:1 imports model_checks.mutants"]),
    ("model_checks.traces", "import importlib\nm = importlib.import_module('odb_torch.loader')\n", False,
     ["model_checks.traces:2 imports odb_torch.loader"]),
    ("model_checks.report", "__import__('odb_tools')\n", False, ["model_checks.report:1 imports odb_tools"]),
    ("odb_torch", "from tests.torch_support import x\n", True,
     ["odb_torch:1 imports tests.torch_support", "odb_torch:1 imports tests.torch_support.x"]),
    ("odb_tools.cli", "import odb_core, odb_torch, model_checks\nfrom odb_tools.demo import run_demo\n"
     "from .profile import profile\n", False, []),
])
def test_violations_are_found(module: str, source: str, is_package: bool, bad: list[str] | None) -> None:
    if bad is None:
        with pytest.raises(ValueError, match="beyond the top"):
            violations(source, module, is_package)
    else:
        assert violations(source, module, is_package) == bad


def test_relative_imports_resolve() -> None:
    assert imports("from . import x\nfrom .y import z\n", "odb_tools.demo", is_package=True) == [
        (1, "odb_tools.demo"), (1, "odb_tools.demo.x"), (2, "odb_tools.demo.y"), (2, "odb_tools.demo.y.z")]
    assert imports("from .. import loader\n", "odb_torch.integrations.hf") == [(1, "odb_torch"), (1, "odb_torch.loader")]


def test_importing_the_runtime_loads_no_tools() -> None:
    """At run time too: importing every module of odb_core, model_checks and odb_torch (not the
    adapters, which need their extras) loads nothing of odb_tools, and odb_core/model_checks load
    no odb_torch."""
    code = """
import importlib, pkgutil, sys
def load(pkg, skip=()):
    importlib.import_module(pkg)
    for m in pkgutil.walk_packages(sys.modules[pkg].__path__, pkg + "."):
        if not m.name.startswith(skip):
            importlib.import_module(m.name)
load("odb_core"); load("model_checks")
assert not [m for m in sys.modules if m.split(".")[0] in ("odb_torch", "odb_tools")], sorted(sys.modules)
load("odb_torch", skip=("odb_torch.integrations",))
bad = [m for m in sys.modules if m.split(".")[0] == "odb_tools"]
assert not bad, bad
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr


def test_every_package_directory_is_installed() -> None:
    """pyproject's package list names every directory with an ``__init__.py`` (a missing one
    is left out of a non-editable install, as ``odb_tools.tune`` was)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for pkg in PACKAGES for p in (ROOT / pkg).rglob("__init__.py")}
    assert found - listed == set(), "packages missing from pyproject.toml"
    assert listed - found == set(), "pyproject.toml lists a package that does not exist"
