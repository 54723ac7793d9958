"""`fractus-pod dashboard` as a real child process on a free port, for the dashboard tests."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RECORDED_POD = REPO / "tests" / "fixtures" / "recorded_pod"


def copy_recorded_pod(dest: Path) -> Path:
    """A writable copy of tests/fixtures/recorded_pod (tests append lines to it)."""
    shutil.copytree(RECORDED_POD, dest)
    return dest


class DashboardProcess:
    """Starts `fractus-pod --pod-dir POD dashboard --port 0` and reads its URL."""

    def __init__(self, pod: Path, env: dict | None = None, timeout: float = 60):
        self.log = open(pod.parent / f"dashboard_{time.time_ns()}.out", "w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "launcher.cli", "--pod-dir", str(pod), "dashboard",
             "--port", "0"],
            cwd=REPO, env={**os.environ, **(env or {})}, stdout=self.log,
            stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            match = re.search(r"on (http://127\.0\.0\.1:\d+/)", self.output())
            if match:
                self.url = match.group(1)
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"dashboard did not start: {self.output()}")
            time.sleep(0.1)

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(self.url + path.lstrip("/"), timeout=30) as res:
                return res.status, res.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
