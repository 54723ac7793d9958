"""`status` on a terminal and in a pipe (issue 25, item 11): a pipe fits $COLUMNS, a wider
terminal never shows fewer columns, and Ctrl-C in `--watch` echoes nothing into the frame
(an echoed `^C` that wrapped its last line made the last redraw repeat its first line).

Real processes: `python -m launcher.cli status` in a pipe and on a pseudo-terminal."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import termios
import time

import pytest

from launcher.dashboard.status_table import fit_columns
from tests.support.dashboard import REPO, copy_recorded_pod

ROW = {"gpu": 0, "pid": 4_190_001, "alive": True, "node": None, "state": "running",
       "stage": 3, "phase": 1, "phases": 2, "next_token": 1_234_567_890, "shard_pct": 45.67,
       "ema_tf": 3.12345, "ema_ss": 3.23456, "lb": 1.002, "tok_s": 123456.0, "mem_gb": 71.25,
       "checkpoint_age_s": 7300, "hub_revision": "f" * 40, "verdict": "Successful",
       "reason": "AR 7.8124 vs baseline 7.7310 (+0.0814, limit 0.2500)",
       "verdict_from_last_run": False}


def status(pod, *args, env=None):
    return subprocess.run([sys.executable, "-m", "launcher.cli", "--pod-dir", str(pod),
                           "status", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


def test_issue25_piped_status_fits_COLUMNS(tmp_path):
    pod = copy_recorded_pod(tmp_path / "pod")
    env = dict(os.environ)
    env.pop("COLUMNS", None)
    wide = subprocess.run([sys.executable, "-m", "launcher.cli", "--pod-dir", str(pod),
                           "status"], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=env)
    assert wide.returncode == 0, wide.stderr
    assert max(len(line) for line in wide.stdout.splitlines()) > 80    # 200 without it
    fitted = status(pod, env={"COLUMNS": "80"})
    assert fitted.returncode == 0, fitted.stderr
    assert max(len(line) for line in fitted.stdout.splitlines()) <= 80, fitted.stdout


@pytest.mark.parametrize("rows", [1, 8])
def test_issue25_a_wider_terminal_never_shows_fewer_columns(rows):
    report = [{**ROW, "gpu": g} for g in range(rows)]
    kept = {w: {c.header for c, _, _ in fit_columns(report, w)} for w in range(40, 260)}
    for width in range(40, 259):
        assert kept[width] <= kept[width + 1], (width, kept[width] - kept[width + 1])


def test_issue25_ctrl_c_in_watch_echoes_nothing_and_gives_the_terminal_back(tmp_path):
    pod = copy_recorded_pod(tmp_path / "pod")
    pid, fd = pty.fork()
    if pid == 0:                         # the child: status --watch on the terminal
        os.chdir(REPO)
        os.execvp(sys.executable, [sys.executable, "-m", "launcher.cli", "--pod-dir",
                                   str(pod), "status", "--watch"])
    out = b""
    try:
        deadline = time.monotonic() + 120
        while b"recent events" not in out and time.monotonic() < deadline:
            if select.select([fd], [], [], 0.2)[0]:
                out += os.read(fd, 65536)
        assert b"recent events" in out, out[-2000:]
        assert not termios.tcgetattr(fd)[3] & termios.ECHO      # keys are not echoed
        os.write(fd, b"\x03")                                    # Ctrl-C, as typed
        while True:
            try:
                chunk = os.read(fd, 65536) if select.select([fd], [], [], 30)[0] else b""
            except OSError:                                      # the child closed it
                break
            if not chunk:
                break
            out += chunk
        _, code = os.waitpid(pid, 0)
        pid = None
    finally:
        if pid is not None:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(code) == 0
    assert b"^C" not in out
    assert termios.tcgetattr(fd)[3] & termios.ECHO              # the terminal as it was
    os.close(fd)
