"""What `launch` and `stop` say, and the time a launch holds the GPUs (issue 25, items 7, 15,
25 and 26): every hint runs as printed from any folder, a clean end names no signal, the
foreground launch shows each GPU's numbers in whole lines, the goodput ledger counts the
launcher's whole wall time (start-up checks, final probes and push as their own buckets),
and `stop` says a worker checkpointed only when one had started.

Real processes: the real launcher and tiny CPU workers (one foreground launch per module,
3 steps on 2 GPUs), a `--detach` launch on a copy, a process holding the pod lock as a
launcher does for `stop`."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.dashboard.goodput_files import pod_ledger
from launcher.pod.events import EventLog, read_events
from launcher.pod.lock import read_holder
from tests.support.e2e import PROCESS_S, REPO, make_pod, wait_for
from tests.support.pods import copy_pod


def fractus_pod(pod: Path, *args: str, cwd: Path = REPO, timeout: float = PROCESS_S):
    return subprocess.run([sys.executable, "-m", "launcher.cli", "--pod-dir", str(pod), *args],
                          cwd=cwd, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """A pod after a foreground `launch --max-steps 3` on GPUs 0 and 1, and what it printed."""
    pod = make_pod(tmp_path_factory.mktemp("launched"))
    done = fractus_pod(pod, "launch", "--stage", "1", "--gpus", "0,1", "--max-steps", "3")
    assert done.returncode == 0, done.stdout + done.stderr
    return pod, done


def hints(text: str) -> list[str]:
    return [h for h in re.findall(r"`([^`]+)`", text) if h.startswith("fractus-pod")]


def test_issue25_launch_hints_name_the_pod_dir_and_run_from_any_folder(launched, tmp_path):
    pod, done = launched
    shown = hints(done.stdout)
    assert {h.split()[-1] for h in shown} == {"status", "stop"}, done.stdout
    status = [h for h in shown if h.endswith(" status")][0]
    assert f"--pod-dir {pod}" in status
    ran = subprocess.run(status, shell=True, cwd=tmp_path, capture_output=True, text=True,
                         timeout=PROCESS_S)
    assert ran.returncode == 0 and f"pod {pod}" in ran.stdout, ran.stdout + ran.stderr


def test_issue25_detach_hints_name_the_pod_dir(launched, tmp_path):
    pod = copy_pod(launched[0], tmp_path / "pod")
    done = fractus_pod(pod, "launch", "--gpus", "0", "--max-steps", "1", "--detach")
    assert done.returncode == 0, done.stdout + done.stderr
    wait_for(lambda: read_holder(pod) is None, PROCESS_S, "the detached launcher's end")
    shown = hints(done.stdout)
    assert {h.split()[-1] for h in shown} == {"status", "stop"}, done.stdout
    assert all(f"--pod-dir {pod} " in h for h in shown), shown
    assert str(pod / "logs" / "launcher.log") in done.stdout
    # The progress line is the foreground's: the background launcher's log has none.
    assert "progress " not in (pod / "logs" / "launcher.log").read_text()


def test_issue25_a_clean_end_says_nothing_of_a_signal(launched):
    _pod, done = launched
    assert "final push to" in done.stderr, done.stderr
    assert "signal again" not in done.stdout + done.stderr


def test_issue25_the_foreground_launch_shows_each_gpus_numbers_in_whole_lines(launched):
    _pod, done = launched
    assert "\r" not in done.stdout
    lines = [line for line in done.stdout.splitlines() if line.startswith("progress ")]
    assert len(lines) >= 2, done.stdout            # at the start and at the end, at least
    last = lines[-1]
    for gpu in ("gpu0", "gpu1"):
        numbers = re.search(rf"{gpu} ([\d,]+) tok ([\d,]+) tok/s ema_tf (\d+\.\d+)", last)
        assert numbers and int(numbers[1].replace(",", "")) > 0, last


def test_issue25_goodput_counts_the_launchers_whole_wall_time(launched):
    pod, _done = launched
    events = read_events(pod)
    (launch,) = [e for e in events if e["event"] == "launch"]
    (end,) = [e for e in events if e["event"] == "launch_end"]
    ledger = pod_ledger(pod)
    lost = ledger.lost_s()
    # The start-up checks ran before the launch event; the final push after the end event.
    assert launch["startup_s"] > 0 and lost["startup"] == pytest.approx(2 * launch["startup_s"])
    assert lost["final_push"] > 0
    assert ledger.wall_s == pytest.approx(end["ts"] - launch["ts"] + launch["startup_s"])
    for gpu, led in ledger.gpus.items():
        assert led.wall_s == pytest.approx(ledger.wall_s), gpu
        assert led.trained_s + led.lost_total_s == pytest.approx(led.wall_s), gpu


HOLDER = """
import signal, sys, time
from pathlib import Path
from launcher.pod.events import EventLog
from launcher.pod.lock import PodLock
pod = Path(sys.argv[1])
lock = PodLock(pod)
lock.acquire()
if sys.argv[2] == "started":
    EventLog(pod).emit("worker_start", gpu=0, pid=0, start_token=0)
def stopped(*_):
    lock.release()
    sys.exit(0)
signal.signal(signal.SIGTERM, stopped)
print("holding", flush=True)
while True:
    time.sleep(0.1)
"""


@pytest.mark.parametrize("workers, said", [
    ("none", "no worker had started: nothing to checkpoint"),
    ("started", "every worker checkpointed"),
])
def test_issue25_stop_says_a_worker_checkpointed_only_when_one_had_started(tmp_path, workers,
                                                                           said):
    pod = tmp_path / "pod"
    assert fractus_pod(pod, "init", "--no-data").returncode == 0
    EventLog(pod).emit("worker_start", gpu=0, pid=0, start_token=0)   # an earlier launch's
    time.sleep(0.01)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(pod), workers], cwd=REPO,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        done = fractus_pod(pod, "stop")
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip().endswith(said), done.stdout
        other = ("every worker checkpointed" if workers == "none"
                 else "nothing to checkpoint")
        assert other not in done.stdout
    finally:
        holder.kill()
        holder.wait()
