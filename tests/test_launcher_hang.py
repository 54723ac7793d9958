"""End to end: a worker that stops logging (FRACTUS_FAULT=hang@8) is detected, killed,
counted as a crash and restarted from its last checkpoint.

Uses the pod helpers of tests/support/e2e.py (real launcher, real tiny CPU workers).
"""

import os
import signal

from tests.support.e2e import (TEST_CRITERIA, TOKENS_PER_STEP, Launcher, events_of,
                               launchers, make_pod, wait_for, worker_records)

__all__ = ["launchers"]   # the fixture, imported for pytest

# Short enough to keep the test quick, long enough that a loaded 2-core machine never
# stalls a healthy tiny worker that long between two metrics lines.
HANG_CRITERIA = {**TEST_CRITERIA, "supervision": {
    **TEST_CRITERIA["supervision"], "hang": {"timeout_s": 10, "startup_timeout_s": 120}}}


def test_hang_is_detected_killed_and_restarted(tmp_path, launchers):
    pod = make_pod(tmp_path, criteria=HANG_CRITERIA)
    launcher = Launcher(pod, "--stage", "1", "--fault", "0:hang@8")
    launchers.append(launcher)
    wait_for(lambda: events_of(pod, "hang", gpu=0), 90, "the hang to be detected")
    wait_for(lambda: len(worker_records(pod, 0, "start")) == 2, 60, "the restarted worker")
    # The restart resumes from the step-5 checkpoint and gets past the hang step.
    wait_for(lambda: [r for r in worker_records(pod, 0) if r.get("type") == "metrics"
                      and r["step"] > 9], 60, "training past the hang step")
    os.killpg(launcher.proc.pid, signal.SIGTERM)
    assert launcher.wait(60) == 0
    hang = events_of(pod, "hang", gpu=0)[0]
    assert hang["silent_s"] >= HANG_CRITERIA["supervision"]["hang"]["timeout_s"]
    hung_step = max(r["step"] for r in worker_records(pod, 0)
                    if r.get("type") == "metrics" and r["ts"] < hang["ts"])
    assert hung_step == 7                    # the last step before the injected hang@8
    assert worker_records(pod, 0, "start")[1]["next_token"] == 5 * TOKENS_PER_STEP

