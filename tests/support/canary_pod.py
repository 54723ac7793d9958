"""A tiny CPU pod trained 3 steps at stage 1 by the real launcher (once per session), and a
copy of it per test: the starting point of tests that switch stages through the canary."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.e2e import REPO, TEST_CRITERIA, make_pod, manifest_json
from tests.support.pods import copy_pod

CANARY_STEPS = 3
CRITERIA = {**TEST_CRITERIA, "canary": {"steps": CANARY_STEPS, "timeout_s": 120},
            "probe": {"band": 0.25, "relativeBand": None, "every": 0}}


def fractus_pod(pod: Path, *args: str, env: dict | None = None, timeout: float = 120):
    return subprocess.run([sys.executable, "-m", "launcher.cli", "--pod-dir", str(pod), *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def launched_stage1_pod(root: Path) -> Path:
    """A pod under `root` trained 3 steps at stage 1 by the real launcher on GPU 0 (made once
    per session: tests/conftest.py's launcher_trained_pod)."""
    pod = make_pod(root, criteria=CRITERIA)
    done = fractus_pod(pod, "launch", "--stage", "1", "--gpus", "0", "--max-steps", "3")
    assert done.returncode == 0, done.stdout + done.stderr
    assert manifest_json(pod)["gpu_0"]["stage"] == 1
    return pod


@pytest.fixture
def pod(launcher_trained_pod, tmp_path) -> Path:
    return copy_pod(launcher_trained_pod, tmp_path / "pod")
