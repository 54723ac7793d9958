"""The shape of the product code (launcher/, fractus/) at a revision: lines per package, the
longest functions, the imports left inside functions (each with the comment that says why),
docstring lines and the incident references they carry ('issue N', 'CI stop N'), and the
start-up time of `fractus-pod --help` (median of 5, after one run that compiles the code).

    python -m benchmarks.code_shape                 # the working tree
    python -m benchmarks.code_shape --rev 786783c   # a commit, unpacked by `git archive`

Results: docs/BENCHMARKS.md, "Code shape".
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("launcher", "fractus")
REFERENCE = re.compile(r"\bissue #?\d+|\bCI,? stop \d+", re.IGNORECASE)   # as tests/test_user_docs.py


def package_of(rel: Path) -> str:
    """launcher/hub/x.py -> launcher/hub; launcher/x.py -> launcher (its base modules)."""
    return rel.parent.as_posix()


def docstring_lines(tree: ast.Module) -> int:
    nodes = [tree, *(n for n in ast.walk(tree)
                     if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))]
    total = 0
    for node in nodes:
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            total += body[0].end_lineno - body[0].lineno + 1
    return total


def function_imports(tree: ast.Module, lines: list[str]) -> list[tuple[int, str, str]]:
    """(line, module, why) of each import in a function: why is the comment on it or on the
    line above, else that of the function's first import that has one (the one comment
    tests/test_layering.py asks of a function)."""
    found: dict[int, tuple[str, str]] = {}
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        imports = sorted((n for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))),
                         key=lambda n: n.lineno)
        reasons = []
        for node in imports:
            here, above, i = lines[node.lineno - 1], [], node.lineno - 2
            while i >= 0 and lines[i].strip().startswith("#"):     # the comment block above
                above.insert(0, lines[i].strip()[1:].strip())
                i -= 1
            reasons.append(here.split("#", 1)[1].strip() if "#" in here else " ".join(above))
        first = next((why for why in reasons if why), "")
        for node, why in zip(imports, reasons):
            module = node.module if isinstance(node, ast.ImportFrom) else \
                ", ".join(a.name for a in node.names)
            module = "." * getattr(node, "level", 0) + (module or "")
            if node.lineno not in found or not found[node.lineno][1]:   # inner function: once
                found[node.lineno] = (module, why or first)
    return sorted((line, module, why) for line, (module, why) in found.items())


def shape(root: Path) -> dict:
    packages: Counter = Counter()
    functions, imports = [], []
    doc_lines = references = 0
    for top in PRODUCT:
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root)
            text = path.read_text()
            lines = text.split("\n")
            packages[package_of(rel)] += len(text.splitlines())
            tree = ast.parse(text)
            doc_lines += docstring_lines(tree)
            references += len(REFERENCE.findall(text))
            functions += [(n.end_lineno - n.lineno + 1, f"{rel}:{n.lineno} {n.name}")
                          for n in ast.walk(tree)
                          if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
            imports += [(f"{rel}:{line}", module, why) for line, module, why
                        in function_imports(tree, lines)]
    imports = sorted(set(imports), key=lambda i: (i[0].split(":")[0], int(i[0].split(":")[1])))
    return {"packages": dict(sorted(packages.items())), "total": sum(packages.values()),
            "longest": sorted(functions, reverse=True)[:5], "imports": imports,
            "docstring_lines": doc_lines, "references": references}


def help_seconds(root: Path, runs: int = 5) -> float:
    """Median wall time of `python -m launcher.cli --help` run from `root` (its code first on
    sys.path), after one run that writes the byte code."""
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": ""}
    times = []
    for i in range(runs + 1):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "launcher.cli", "--help"], cwd=root, env=env,
                       check=True, stdout=subprocess.DEVNULL)
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def unpacked(rev: str, into: Path) -> Path:
    """The tree of `rev` under `into` (git archive: no work tree of the checkout touched)."""
    archive = subprocess.run(["git", "archive", rev], cwd=REPO, check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def report(root: Path, label: str) -> None:
    got = shape(root)
    print(f"# code shape of {label}\n")
    print("| package | lines |\n|---|---:|")
    for name, count in got["packages"].items():
        print(f"| {name} | {count:,} |")
    print(f"| **product code** | **{got['total']:,}** |\n")
    print("longest functions:")
    for length, where in got["longest"]:
        print(f"  {length:4d} lines  {where}")
    print(f"\nfunction-level imports: {len(got['imports'])} "
          f"(launcher/cli: {sum(i[0].startswith('launcher/cli/') for i in got['imports'])})")
    for where, module, why in got["imports"]:
        print(f"  {where}  {module}" + (f"  # {why}" if why else ""))
    print(f"\ndocstring lines: {got['docstring_lines']:,}; 'issue N'/'CI stop N' references: "
          f"{got['references']}")
    print(f"`fractus-pod --help`: {help_seconds(root) * 1000:.0f} ms (median of 5)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", help="a git revision (default: the working tree)")
    args = parser.parse_args()
    if args.rev is None:
        report(REPO, "the working tree")
        return
    with tempfile.TemporaryDirectory(prefix="code-shape-") as tmp:
        report(unpacked(args.rev, Path(tmp)), args.rev)


if __name__ == "__main__":
    main()
