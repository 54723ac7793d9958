"""`fractus-pod launch --from-hub URL` in a child process, for the tests that rebuild a pod
from a hub (test hub server or file:// store)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support.e2e import REPO, kill_workers


def launch_from_hub(pod: Path, url: str, *args: str) -> subprocess.CompletedProcess:
    """The CLI in a child process (nothing may be written into `pod` before it runs)."""
    return fractus_pod(pod, "launch", "--from-hub", url, *args, timeout=150)


def fractus_pod(pod: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """`fractus-pod --pod-dir POD ARGS...` in a child process; the workers it left, killed."""
    try:
        return subprocess.run([sys.executable, "-m", "launcher.cli", "--pod-dir", str(pod),
                               *args], cwd=REPO, capture_output=True, text=True,
                              timeout=timeout)
    finally:
        if pod.is_dir():
            kill_workers(pod)
