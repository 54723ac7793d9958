"""launcher/'s sub-packages import one way only: each may import those after it in LAYERS
(and the base modules), never one before it, at module level or inside a function. And no
test module imports another (shared test helpers live in tests/support/)."""

import ast
from pathlib import Path

LAUNCHER = Path(__file__).resolve().parents[1] / "launcher"
LAYERS = ["cli", "dashboard", "supervise", "alerts", "checks", "worker", "hub", "pod", "config"]
BASE = {"errors", "paths", "files", "child"}     # launcher/*.py, importing no sub-package


def imported_launcher_modules(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "launcher":
                yield node.lineno, [f"launcher.{a.name}" for a in node.names]
            elif node.module.startswith("launcher."):
                yield node.lineno, [node.module]
        elif isinstance(node, ast.Import):
            yield node.lineno, [a.name for a in node.names if a.name.startswith("launcher.")]


def test_every_module_lives_in_a_layer_or_the_base():
    top = {p.stem for p in LAUNCHER.glob("*.py")} - {"__init__"}
    packages = {p.name for p in LAUNCHER.iterdir() if (p / "__init__.py").is_file()}
    assert top == BASE and packages == set(LAYERS)


def test_imports_point_one_way():
    rank = {name: i for i, name in enumerate(LAYERS)}
    upward = []
    for path in LAUNCHER.rglob("*.py"):
        rel = path.relative_to(LAUNCHER)
        mine = rank[rel.parts[0]] if len(rel.parts) > 1 else len(LAYERS)   # base: lowest
        for line, modules in imported_launcher_modules(path):
            for module in modules:
                theirs = module.split(".")[1]
                if theirs in rank and rank[theirs] < mine:
                    upward.append(f"{rel}:{line} imports {module}")
    assert not upward, "\n".join(upward)


def test_no_test_module_imports_another():
    """Shared helpers live in tests/support/: a test module imported by another is collected
    (its fixtures and module-scoped pods included) wherever it is imported, and splitting or
    deleting it breaks files that do not mention it."""
    root = LAUNCHER.parent
    found = []
    for path in [*(root / "tests").rglob("*.py"), *(root / "benchmarks").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module else
                     [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            found += [f"{path.relative_to(root)}:{node.lineno} imports {name}" for name in names
                      if name.startswith("tests.test_")]
    assert not found, "\n".join(found)
