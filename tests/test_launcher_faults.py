"""End to end, worker faults: a SIGKILLed worker restarts and resumes from its checkpoint,
and a second launcher on the same pod is refused.

Uses the pod helpers of tests/support/e2e.py (real launcher, real tiny CPU workers).
"""

import json
import os
import signal
import subprocess
import sys

from launcher.worker.process import read_records

from tests.support.e2e import (PROCESS_S, REPO, Launcher, events_of, launchers,
                               make_pod, wait_for, worker_records)

__all__ = ["launchers"]   # the fixture, imported for pytest


def test_sigkilled_worker_restarts_and_resumes_and_second_launcher_is_refused(
        tmp_path, launchers, capfd):
    pod = make_pod(tmp_path)
    launcher = Launcher(pod, "--stage", "1")
    launchers.append(launcher)
    wait_for(lambda: worker_records(pod, 0, "checkpoint"), PROCESS_S,
             "a checkpoint on GPU 0")

    # A second launcher on the same pod is refused, and starts nothing.
    starts_before = len(events_of(pod, "worker_start"))
    second = subprocess.run([sys.executable, "-m", "launcher.cli", "--pod-dir", str(pod),
                             "launch", "--stage", "1"], cwd=REPO, capture_output=True,
                            text=True, timeout=PROCESS_S)
    assert second.returncode == 2
    assert "another launcher" in second.stderr and len(second.stderr.strip().splitlines()) == 1
    assert len(events_of(pod, "worker_start")) == starts_before

    pid = events_of(pod, "worker_start", gpu=0)[-1]["pid"]
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: len(events_of(pod, "worker_start", gpu=0)) == 2, PROCESS_S, "the restart")
    (crash,) = events_of(pod, "worker_crash", gpu=0)
    assert "-9" in crash["reason"]
    wait_for(lambda: len(worker_records(pod, 0, "start")) == 2, PROCESS_S,
             "the worker's start event")
    os.killpg(launcher.proc.pid, signal.SIGTERM)
    assert launcher.wait(PROCESS_S) == 0, launcher.output()

    records = worker_records(pod, 0)
    second_start = [i for i, r in enumerate(records) if r.get("event") == "start"][1]
    last_ckpt = [r for r in records[:second_start] if r.get("event") == "checkpoint"][-1]
    assert records[second_start]["next_token"] == last_ckpt["next_token"]
    assert events_of(pod, "worker_start", gpu=0)[-1]["start_token"] == last_ckpt["next_token"]


def test_a_worker_sigtermed_by_someone_else_restarts_from_its_final_checkpoint(
        tmp_path, launchers):
    """Issue 16 item 26. Seen: a worker SIGTERMed by someone else checkpoints, exits 0 and
    was taken as done: never restarted, its GPU idle while the pod said running."""
    pod = make_pod(tmp_path)
    launcher = Launcher(pod, "--stage", "1", "--gpus", "0")
    launchers.append(launcher)
    wait_for(lambda: worker_records(pod, 0, "checkpoint"), PROCESS_S, "a checkpoint on GPU 0")
    os.kill(events_of(pod, "worker_start", gpu=0)[-1]["pid"], signal.SIGTERM)
    wait_for(lambda: len(events_of(pod, "worker_start", gpu=0)) == 2, PROCESS_S, "the restart")
    wait_for(lambda: len(worker_records(pod, 0, "start")) == 2, PROCESS_S,
             "the worker's start event")
    (done,) = worker_records(pod, 0, "done")
    assert done["reason"] == "signal"
    (ended,) = events_of(pod, "worker_exit", gpu=0)
    assert ended["code"] == 0
    records = worker_records(pod, 0)
    second_start = [i for i, r in enumerate(records) if r.get("event") == "start"][1]
    final = [r for r in records[:second_start] if r.get("event") == "checkpoint"][-1]
    assert events_of(pod, "worker_start", gpu=0)[-1]["start_token"] == final["next_token"]
    os.killpg(launcher.proc.pid, signal.SIGTERM)
    assert launcher.wait(PROCESS_S) == 0, launcher.output()


def test_logs_moved_mid_run_fail_the_pod_in_one_line_with_the_workers_stopped(
        tmp_path, launchers):
    """Issue 16 item 26. Seen: `mv logs logs.moved` mid-run gave a FileNotFoundError
    traceback (exit 1), or the launcher recreated logs/ and declared both healthy workers
    hung. Now: a pod error in one line, the workers stopped gracefully (each checkpointed),
    no traceback, logs/ not recreated."""
    pod = make_pod(tmp_path)
    launcher = Launcher(pod, "--stage", "1")     # its output file moves with logs/, open
    launchers.append(launcher)
    wait_for(lambda: worker_records(pod, 0, "checkpoint") and worker_records(pod, 1,
             "checkpoint"), PROCESS_S, "a checkpoint on each GPU")
    (pod / "logs").rename(pod / "logs.moved")
    code = launcher.wait(PROCESS_S)
    text = launcher.output()
    assert code == 1, text
    assert "Traceback" not in text and "logs/ was moved" in text, text
    moved = pod / "logs.moved"
    for gpu in (0, 1):
        done = [r for r in read_records(moved / f"metrics_gpu{gpu}.jsonl")
                if r.get("event") == "done"]
        assert done and done[-1]["reason"] == "signal", gpu      # stopped gracefully
    # Nothing made a new logs/ (an empty one would hide the moved folder's records and make
    # healthy workers look hung), and no worker was taken for hung.
    assert not (pod / "logs").exists()
    recorded = [json.loads(line) for line in (moved / "events.jsonl").read_text().splitlines()]
    assert not [e for e in recorded if e["event"] in ("hang", "worker_crash")]


def test_a_rollback_asked_of_the_running_launcher_is_carried_out_by_it(tmp_path, launchers):
    """Issue 16 item 24, the real path: the request names the lock holder's launcher_id, and
    the launcher it was asked of takes it (a later launcher would drop it as stale)."""
    pod = make_pod(tmp_path)
    launcher = Launcher(pod, "--stage", "2", "--gpus", "0")
    launchers.append(launcher)
    wait_for(lambda: worker_records(pod, 0, "checkpoint"), PROCESS_S, "a checkpoint on GPU 0")
    asked = subprocess.run([sys.executable, "-m", "launcher.cli", "--pod-dir", str(pod),
                            "rollback", "--to-stage", "1"], cwd=REPO, capture_output=True,
                           text=True, timeout=PROCESS_S)
    assert asked.returncode == 0 and "asked the running launcher" in asked.stdout, asked
    wait_for(lambda: events_of(pod, "pod_running", after="rollback"), PROCESS_S,
             "the rollback carried out")
    assert not events_of(pod, "rollback_request_stale")
    os.killpg(launcher.proc.pid, signal.SIGTERM)
    assert launcher.wait(PROCESS_S) == 0, launcher.output()
