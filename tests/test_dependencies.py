"""Declared support is what the code needs (issue 16 item 9): every third-party package that
fractus/ and launcher/ import is declared in pyproject.toml (dependencies or the `ray` or
`tracker` extra), and every declared dependency is imported somewhere; the Python floor is
the one `python -P` needs."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OWN_PACKAGES = {"fractus", "launcher"}


def imported_top_level_modules() -> set[str]:
    """Top-level names of every absolute import in fractus/ and launcher/ (in functions too)."""
    names = set()
    for package in OWN_PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names |= {alias.name.split(".")[0] for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names.add(node.module.split(".")[0])
    return names - OWN_PACKAGES - set(sys.stdlib_module_names)


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    return normalized(re.match(r"[A-Za-z0-9_.-]+", requirement).group(0))


def test_declared_dependencies_are_exactly_the_imported_ones():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = {requirement_name(r) for r in project["dependencies"]}
    # The two features whose imports are lazy and refused in one line when missing.
    extras = {requirement_name(r) for extra in ("ray", "tracker")
              for r in project["optional-dependencies"][extra]}
    distributions = importlib.metadata.packages_distributions()
    imported = {}
    for module in imported_top_level_modules():
        assert module in distributions, f"{module} is imported but no installed package provides it"
        (dist,) = {normalized(d) for d in distributions[module]}
        imported[dist] = module
    undeclared = sorted(set(imported) - declared - extras)
    unused = sorted(declared - set(imported))
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"
    assert not unused, f"declared in pyproject.toml but never imported: {unused}"


def test_requires_python_is_what_python_dash_p_needs():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == ">=3.11"      # `-P` (safe path) is new in 3.11
    assert sys.version_info >= (3, 11)
