"""Every file name fractus-pod gives inside a pod directory is named in launcher/paths.py,
also the names of files inside a pod folder (a prefix, a lock, a state file), not only the
paths that start with one: a module-level constant whose name says it names a file is
defined there, apart from the few that name something outside the pod (listed with why)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

LAUNCHER = Path(__file__).resolve().parents[1] / "launcher"
FILE_NAME = re.compile(r"_(PREFIX|SUFFIX|LOCK|STATE|FILE|DIR|PATH|LOG|NAME)$")
NOT_POD_PATHS = {
    ("hub/integrity.py", "INDEX_PATH"): "in the hub repository, not the pod",
    ("hub/lease.py", "LEASE_PATH"): "in the hub repository, not the pod",
    ("hub/fetch.py", "PARTIAL_SUFFIX"): "beside the shard the config names, wherever it is",
    ("checks/probe_outcome.py", "CHECK_NAME"): "a health check's name, not a file",
}


def file_name_constants(path: Path) -> list[str]:
    found = []
    for node in ast.parse(path.read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AnnAssign) else []
        value = getattr(node, "value", None)
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            found += [t.id for t in targets if isinstance(t, ast.Name) and FILE_NAME.search(t.id)]
    return found


def test_file_names_inside_the_pod_are_named_in_paths_py():
    stray = []
    for path in sorted(LAUNCHER.rglob("*.py")):
        where = path.relative_to(LAUNCHER).as_posix()
        if where == "paths.py":
            continue
        stray += [f"launcher/{where}: {name}" for name in file_name_constants(path)
                  if (where, name) not in NOT_POD_PATHS]
    assert not stray, "define these in launcher/paths.py:\n" + "\n".join(stray)


def test_the_exceptions_still_exist():
    """An exception that no longer matches anything is taken off the list."""
    for where, name in NOT_POD_PATHS:
        assert name in file_name_constants(LAUNCHER / where), (where, name)
