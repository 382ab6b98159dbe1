"""The shape rules of issue 24, checked on every module of the project's packages.

- No module over `MAX_LINES` lines, unless its docstring says why it is one concept (the words "one concept").
- No class over `MAX_METHODS` methods (functions defined in its body, properties and dunders included).
- Every package the dispatcher ships is a root package of the import contracts, so `lint-imports` sees it.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = (
    "warmpool",
    "manifests",
    "autoscaler",
    "oncall",
    "nodeagent",
    "gateway",
    "simulate",
    "demo",
    "kube",
    "pulsescale",
    "bridge",
    "integrations",
)
MAX_LINES = 600
MAX_METHODS = 25


def _modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if "__pycache__" not in p.parts)


def _rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


@pytest.mark.parametrize("path", _modules(), ids=_rel)
def test_a_module_is_short_or_says_why_it_is_one_concept(path: Path) -> None:
    text = path.read_text()
    lines = text.count("\n")
    if lines <= MAX_LINES:
        return
    doc = ast.get_docstring(ast.parse(text)) or ""
    assert "one concept" in doc, f"{_rel(path)} has {lines} lines (> {MAX_LINES}) and its docstring does not say why"


@pytest.mark.parametrize("path", _modules(), ids=_rel)
def test_no_class_has_more_than_25_methods(path: Path) -> None:
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            methods = [n for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
            assert len(methods) <= MAX_METHODS, f"{_rel(path)}: class {node.name} has {len(methods)} methods"


def test_every_package_is_under_the_import_contracts() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    roots = set(config["tool"]["importlinter"]["root_packages"])
    assert roots == set(PACKAGES)
    found = set(config["tool"]["setuptools"]["packages"]["find"]["include"])
    assert found == {f"{p}*" for p in PACKAGES}
    # Each package with modules of its own has an exhaustive layers contract over it.
    layered = {
        c
        for contract in config["tool"]["importlinter"]["contracts"]
        if contract.get("exhaustive")
        for c in contract.get("containers", [])
    }
    assert set(PACKAGES) <= layered, set(PACKAGES) - layered
