"""End to end: a worker that stops logging (FRACTUS_FAULT=hang@8) is detected, killed,
counted as a crash and restarted from its last checkpoint; with the other GPU killed -9 in
the same run, the goodput ledger of the run adds up per GPU and names both incidents.

Uses the pod helpers of tests/support/e2e.py (real launcher, real tiny CPU workers).
"""

import os
import signal

from pytest import approx

from tests.support.e2e import (TEST_CRITERIA, TOKENS_PER_STEP, Launcher, events_of,
                               launchers, make_pod, wait_for, worker_records)
from tests.support.ledger import assert_ledger_adds_up, metrics_lines

__all__ = ["launchers"]   # the fixture, imported for pytest

# Short enough to keep the test quick, long enough that a loaded 2-core machine never
# stalls a healthy tiny worker that long between two metrics lines.
HANG_CRITERIA = {**TEST_CRITERIA, "supervision": {
    **TEST_CRITERIA["supervision"], "hang": {"timeout_s": 10, "startup_timeout_s": 120}}}


def test_hang_is_detected_killed_and_restarted(tmp_path, launchers):
    pod = make_pod(tmp_path, criteria=HANG_CRITERIA)
    launcher = Launcher(pod, "--stage", "1", "--fault", "0:hang@8")
    launchers.append(launcher)
    # GPU 1 killed -9 three lines past its first checkpoint: work its restart trains again.
    saved = wait_for(lambda: worker_records(pod, 1, "checkpoint"), 120, "GPU 1's checkpoint")
    wait_for(lambda: metrics_lines(pod, 1)[-1]["next_token"]
             >= saved[0]["next_token"] + 3 * TOKENS_PER_STEP, 60, "GPU 1 past its checkpoint")
    os.kill(events_of(pod, "worker_start", gpu=1)[-1]["pid"], signal.SIGKILL)
    wait_for(lambda: events_of(pod, "hang", gpu=0), 90, "the hang to be detected")
    wait_for(lambda: len(worker_records(pod, 0, "start")) == 2, 60, "the restarted worker")
    # The restart resumes from the step-5 checkpoint and gets past the hang step.
    wait_for(lambda: [r for r in worker_records(pod, 0) if r.get("type") == "metrics"
                      and r["step"] > 9], 60, "training past the hang step")
    wait_for(lambda: len(worker_records(pod, 1, "start")) == 2 and metrics_lines(pod, 1)[-1]
             ["ts"] > worker_records(pod, 1, "start")[1]["ts"], 60, "GPU 1 training again")
    os.killpg(launcher.proc.pid, signal.SIGTERM)
    assert launcher.wait(60) == 0
    hang = events_of(pod, "hang", gpu=0)[0]
    assert hang["silent_s"] >= HANG_CRITERIA["supervision"]["hang"]["timeout_s"]
    hung_step = max(r["step"] for r in worker_records(pod, 0)
                    if r.get("type") == "metrics" and r["ts"] < hang["ts"])
    assert hung_step == 7                    # the last step before the injected hang@8
    assert worker_records(pod, 0, "start")[1]["next_token"] == 5 * TOKENS_PER_STEP
    ledger = assert_ledger_adds_up(pod)
    # Hang: from its last line to the detection (at least the silence the supervisor saw,
    # which began when it read that line); crash: from the last line to the kill -9.
    last_line = max(r["ts"] for r in metrics_lines(pod, 0) if r["ts"] < hang["ts"])
    assert ledger.gpus[0].lost_s["hang"] == approx(hang["ts"] - last_line)
    assert ledger.gpus[0].lost_s["hang"] >= hang["silent_s"]
    assert ledger.gpus[0].lost_s["crash"] == 0 and ledger.gpus[1].lost_s["hang"] == 0
    assert ledger.gpus[1].lost_s["crash"] > 0
    # GPU 0's restart from step 5 logs step 6 (its load ends there), then trains step 7 again.
    assert ledger.gpus[0].lost_s["retrain_crash"] > 0
