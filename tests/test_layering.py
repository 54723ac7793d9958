"""launcher/'s sub-packages import one way only: each may import those after it in LAYERS
(and the base modules), never one before it, at module level or inside a function; inside a
package no modules import each other in a circle either. And no test module imports another
(shared test helpers live in tests/support/)."""

import ast
import re
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


def module_name(path: Path) -> str:
    parts = path.relative_to(LAUNCHER.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(tree) -> set[int]:
    """Line numbers of imports under `if TYPE_CHECKING:` (never run: no circle at run time)."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            lines |= {n.lineno for stmt in node.body for n in ast.walk(stmt)
                      if isinstance(n, (ast.Import, ast.ImportFrom))}
    return lines


def import_graph(type_level: bool = False) -> dict[str, set[str]]:
    """module -> the launcher modules it imports, at module level or in a function, relative
    imports included (`from .store import x`, `from launcher.hub import open_store`: the
    package's __init__, `from launcher import child`: the module); with `type_level`, those
    under `if TYPE_CHECKING:` too."""
    paths = {module_name(p): p for p in LAUNCHER.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        tree = ast.parse(path.read_text())
        skip, found = set() if type_level else _type_checking_only(tree), set()
        package = name if path.stem == "__init__" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if getattr(node, "lineno", None) in skip:
                continue
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join([*package.split(".")[:len(package.split(".")) - node.level
                                                        + 1], *([base] if base else [])])
                found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base
                          for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
        graph[name] = {m for m in found if m in paths and m != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


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


def test_no_import_circles():
    """Inside a package too (canary <-> trusted_loss <-> probe_check through function-level
    imports, hub/store.py <-> hf.py/local.py through open_store were two): a circle works
    only while one of its imports stays inside a function, and breaks the day someone
    moves that import to the top of its module; it also says the two modules are one."""
    found = cycles(import_graph())
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_no_import_circles_at_type_level_either():
    """An import under `if TYPE_CHECKING:` never runs, but a circle through one still says
    the two modules are one (and a type checker walks it): pod_run -> tracker_sink ->
    pod_view -> pod_run (through `warn`) and ray_adopt <-> ray_backend were two."""
    found = cycles(import_graph(type_level=True))
    assert not found, "type-level import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_circle_finder_sees_function_level_and_relative_imports():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    got = import_graph()
    assert "launcher.hub.store" in got["launcher.hub.local"]          # from .store import ...
    assert "launcher.checks.trusted_loss" in got["launcher.supervise.plan"]


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


def defined_in(module: Path) -> dict[str, str]:
    """Top-level names a module defines (not imports) -> its dotted name."""
    dotted = "launcher." + module.stem
    names = {}
    for node in ast.parse(module.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names[node.name] = dotted
        elif isinstance(node, ast.Assign):
            names.update({t.id: dotted for t in node.targets if isinstance(t, ast.Name)})
    return {n: m for n, m in names.items() if not n.startswith("_")}


def test_pod_paths_and_file_helpers_have_one_home():
    """launcher/paths.py names every pod path and launcher/files.py holds the file helpers
    (atomic writes, sha256): their names are imported from them under their own names, used
    where imported (no module re-exports one for others), and no other module defines a
    constant of its own that names a pod file."""
    root = LAUNCHER.parent
    homes = {**defined_in(LAUNCHER / "paths.py"), **defined_in(LAUNCHER / "files.py")}
    pod_dirs = ("logs/", "checkpoints/", "scratch/", "manifests/", ".fractus")
    found = []
    for path in [*LAUNCHER.rglob("*.py"), *(root / "tests").rglob("*.py"),
                 *(root / "benchmarks").rglob("*.py")]:
        if path in (LAUNCHER / "paths.py", LAUNCHER / "files.py"):
            continue
        tree = ast.parse(path.read_text())
        used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        where = path.relative_to(root)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    home = homes.get(alias.name)
                    if home is None or not node.module.startswith("launcher"):
                        continue
                    if node.module != home:
                        found.append(f"{where}:{node.lineno} takes {alias.name} from "
                                     f"{node.module}, not {home}")
                    elif alias.asname not in (None, alias.name):
                        found.append(f"{where}:{node.lineno} renames {alias.name}")
                    elif alias.name not in used:
                        found.append(f"{where}:{node.lineno} re-exports {alias.name}")
        if path.is_relative_to(LAUNCHER):
            for node in tree.body:
                if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                        and isinstance(node.value.value, str)
                        and node.value.value.startswith(pod_dirs)
                        and " " not in node.value.value):     # a message, not a path
                    found.append(f"{where}:{node.lineno} defines a pod path of its own")
    assert not found, "\n".join(found)


def test_no_two_modules_share_a_file_name():
    """A module's name says what it is wherever it is imported or named in a traceback: two
    `local.py` (a backend and a store) or `adopt.py` (a command and its body) did not."""
    seen: dict[str, list[str]] = {}
    for path in LAUNCHER.rglob("*.py"):
        if path.name not in ("__init__.py", "__main__.py"):
            seen.setdefault(path.name, []).append(str(path.relative_to(LAUNCHER)))
    assert not {name: paths for name, paths in seen.items() if len(paths) > 1}


def test_the_code_map_names_every_module():
    """docs/LAUNCHER.md's "Where the code lives" says which file owns what: every module of
    launcher/ is in it, and nothing that is not there any more."""
    text = (LAUNCHER.parent / "docs" / "LAUNCHER.md").read_text()
    assert "## Where the code lives (launcher/)" in text
    section = text.split("## Where the code lives (launcher/)")[1].split("\n## ")[0]
    named = set(re.findall(r"`([a-z_]+\.py)`", section))
    modules = {p.name for p in LAUNCHER.rglob("*.py") if p.name not in ("__init__.py", "__main__.py")}
    assert named == modules, f"not in the map: {sorted(modules - named)}; " \
                             f"gone: {sorted(named - modules)}"


def test_an_import_inside_a_function_says_why():
    """Imports sit at the top of a module. One inside a function is there for a reason (an
    optional extra, torch or another heavy import kept off a fast path, a circle) that a
    comment says, on the function's first such import or the line above it; else a reader
    cannot tell a needed one from a leftover."""
    unexplained = []
    for path in LAUNCHER.rglob("*.py"):
        lines = path.read_text().split("\n")
        for fn in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            nested = {id(n) for inner in ast.walk(fn) if inner is not fn
                      and isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef))
                      for n in ast.walk(inner)}
            own = [n for n in ast.walk(fn)
                   if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in nested]
            if own:
                line = min(n.lineno for n in own)
                if "#" not in lines[line - 1] and not lines[line - 2].strip().startswith("#"):
                    unexplained.append(f"{path.relative_to(LAUNCHER)}:{line}")
    assert not unexplained, "\n".join(sorted(unexplained))
