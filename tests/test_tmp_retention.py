"""A run of the suite leaves little under the temp directory: pytest, with this repository's
settings (pyproject.toml), removes a passed test's tmp_path when it ends and a green run's
base temp directory at its end; a failed test's directory stays, to be looked at. Each
end-to-end test writes tens of MB of checkpoints; pytest's default kept every file of the
last 3 runs (4.6 GB after one run of the suite).

An inner pytest in a subprocess, its temp root under this test's own (PYTEST_DEBUG_TEMPROOT).
"""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

INNER = '''
def test_writes_a_checkpoint(tmp_path):
    (tmp_path / "checkpoint.pt").write_bytes(b"x" * 100_000)

def test_a_shared_pod(tmp_path_factory):
    (tmp_path_factory.mktemp("pod") / "shard.npy").write_bytes(b"x" * 100_000)

def test_fails_keeping_its_files(tmp_path):
    (tmp_path / "evidence.log").write_text("what went wrong")
    assert FAIL is False
'''


def run_inner(tmp_path: Path, fail: bool) -> Path:
    """Run INNER with the repository's pytest settings; returns its temp root."""
    inner, root = tmp_path / "inner", tmp_path / "temproot"
    inner.mkdir(exist_ok=True)
    root.mkdir(exist_ok=True)
    (inner / "test_inner.py").write_text(f"FAIL = {fail}\n" + INNER)
    env = {**os.environ, "PYTEST_DEBUG_TEMPROOT": str(root),
           "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}     # no plugin: a second, not ten
    env.pop("PYTEST_ADDOPTS", None)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "-c", str(REPO / "pyproject.toml"), "--rootdir", str(inner), str(inner)],
        cwd=inner, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == (1 if fail else 0), done.stdout + done.stderr
    return root


def files_under(root: Path) -> list[str]:
    return sorted(p.name for p in root.rglob("*") if p.is_file() and p.name != ".lock")


def test_a_green_run_leaves_no_file_under_the_temp_directory(tmp_path):
    assert files_under(run_inner(tmp_path, fail=False)) == []


def test_a_failed_test_keeps_its_files_and_only_those(tmp_path):
    root = run_inner(tmp_path, fail=True)
    # The session's shared directories stay too: a failed run may need them to be read.
    assert files_under(root) == ["evidence.log", "shard.npy"]
