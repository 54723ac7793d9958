"""`fractus-pod dashboard` as a real child process on a free port, for the dashboard tests."""

from __future__ import annotations

import json
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


def status_in_process(pod: Path, modules: tuple[str, ...]) -> tuple[int, dict, list[str]]:
    """`fractus-pod --pod-dir POD status --json` in a new Python process, as a person runs it:
    its exit code, its report and which of `modules` it imported."""
    script = ("import json, sys\n"
              "from launcher.cli.main import main\n"
              f"code = main(['--pod-dir', {str(pod)!r}, 'status', '--json'])\n"
              f"print(json.dumps({{'code': code, 'loaded': [m for m in {modules!r} "
              "if m in sys.modules]}))\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report_line, verdict_line = done.stdout.strip().splitlines()[-2:]
    verdict = json.loads(verdict_line)
    return verdict["code"], json.loads(report_line), verdict["loaded"]


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
