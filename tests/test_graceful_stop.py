"""`--max-time` and `fractus-pod stop` are graceful in every phase (issue 10, item 14).

Real processes: the launcher CLI as a child process, real tiny CPU workers and canaries,
signals sent by `fractus-pod stop`. Every test starts from a pod the real launcher trained
3 steps at stage 1 on GPU 0 (tests/test_launch_canary.py's fixture; each test a copy).
A worker stuck before its first step (the `hang` fault) stands in for the 1B model's
first compiled step, which takes minutes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psutil

from tests.support.canary_pod import pod  # noqa: F401 (fixture: a launched pod)
from tests.support.e2e import (REPO, TOKENS_PER_STEP, Launcher, events_of,  # noqa: F401
                               launchers, manifest_json, wait_for, worker_records)


def fractus_pod(pod: Path, *args: str, timeout: float = 180):
    return subprocess.run([sys.executable, "-m", "launcher.cli", "--pod-dir", str(pod), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)


def canary_runs_started(pod: Path) -> list[Path]:
    """Canary worker metrics files that hold the worker's `start` record."""
    return [p for p in (pod / "scratch" / "canary").glob("*/stage*/metrics.jsonl")
            if '"start"' in p.read_text()]


def no_canary_worker_left(pod: Path) -> bool:
    for proc in psutil.process_iter(["cmdline", "environ"]):
        try:
            env = proc.info["environ"] or {}
        except psutil.Error:
            continue
        if str(pod / "scratch" / "canary") in env.get("METRICS", ""):
            return False
    return True


def test_max_time_spent_in_the_canary_stops_the_launch_with_nothing_switched(pod):
    # Nothing measured on this pod: a budget the canary is known to exceed is refused before
    # it starts (tests/test_canary_budget.py); an unmeasured one may still run out in it.
    (pod / "logs" / "metrics_gpu0.jsonl").unlink()
    before = manifest_json(pod)["gpu_0"]
    done = fractus_pod(pod, "launch", "--stage", "2", "--gpus", "0", "--max-time", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "stopped during the canary (--max-time reached)" in done.stdout
    assert "nothing switched" in done.stdout
    (canary,) = events_of(pod, "canary")
    assert canary["interrupted"] == "--max-time reached" and not canary["passed"]
    assert not events_of(pod, "worker_start", stage=2)
    assert manifest_json(pod)["gpu_0"] == before             # still stage 1, same resume point
    status = json.loads(fractus_pod(pod, "status", "--json").stdout)
    assert status["stage"] == 1 and status["canary"]["status"] == "Inconclusive"
    assert no_canary_worker_left(pod)


def test_stop_during_the_canary_ends_the_launch_cleanly(pod, launchers):
    before = manifest_json(pod)["gpu_0"]
    launcher = Launcher(pod, "--stage", "2", "--gpus", "0")
    launchers.append(launcher)
    wait_for(lambda: canary_runs_started(pod), 120, "the canary's first worker")
    stopped = fractus_pod(pod, "stop")
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert launcher.wait(60) == 0, launcher.output()
    assert "stopped during the canary (SIGTERM received)" in launcher.output()
    (canary,) = events_of(pod, "canary")
    assert canary["interrupted"] == "SIGTERM received"
    assert not [e for e in events_of(pod, "worker_start") if e["ts"] > canary["ts"]]
    assert manifest_json(pod)["gpu_0"] == before
    assert wait_for(lambda: no_canary_worker_left(pod), 10, "the canary worker to be gone")


def test_stop_while_a_worker_compiles_is_graceful_and_the_switch_stays_recorded(pod, launchers):
    before = manifest_json(pod)["gpu_0"]
    assert before["stage"] == 1
    launcher = Launcher(pod, "--stage", "2", "--gpus", "0", "--fault", "0:hang@4")  # its first step
    launchers.append(launcher)
    (start,) = wait_for(lambda: events_of(pod, "worker_start", stage=2), 180,
                        "the stage-2 worker (after its canary)")
    # The worker is past setup and stuck before its first step (its first compiled step).
    wait_for(lambda: [r for r in worker_records(pod, 0, "start") if r["pid"] == start["pid"]],
             120, "the worker's start record")
    # The switch is recorded before any worker runs: one stage for the whole pod.
    assert manifest_json(pod)["gpu_0"]["stage"] == 2
    assert events_of(pod, "stage_change", reason="launch")[-1]["to_stage"] == 2

    stopped = fractus_pod(pod, "stop")
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert launcher.wait(60) == 0, launcher.output()
    (exit_event,) = [e for e in events_of(pod, "worker_exit") if e["ts"] > start["ts"]]
    assert exit_event["code"] == 0                        # not SIGKILLed after stop_grace_s
    (done,) = [r for r in worker_records(pod, 0, "done") if r["ts"] > start["ts"]]
    assert done["reason"] == "signal_before_first_step"
    after = manifest_json(pod)["gpu_0"]
    assert after["stage"] == 2
    assert (after["start_token"], after["checkpoint_sha256"]) == \
        (before["start_token"], before["checkpoint_sha256"]) == \
        (3 * TOKENS_PER_STEP, before["checkpoint_sha256"])
    status = json.loads(fractus_pod(pod, "status", "--json").stdout)
    assert status["stage"] == 2                           # the next plain launch resumes there


# A probe that takes long (the 1B model's final probes take minutes), once the test says so
# (FRACTUS_*: a name children inherit, launcher/child.py).
SLOW_PROBE = '''
import os, sys, time
_marker = os.environ.get("FRACTUS_TEST_SLOW_PROBE_MARKER")
if _marker and "--checkpoint" in sys.argv and os.path.exists(_marker):
    time.sleep(float(os.environ["FRACTUS_TEST_SLOW_PROBE_S"]))
'''


def test_stop_waits_through_the_final_probes(pod, tmp_path, launchers, monkeypatch):
    import yaml
    from tests.support.canary_pod import CRITERIA
    config = yaml.safe_load((pod / "fractus-pod.yaml").read_text())
    config["stop_grace_s"] = 10.0         # `stop` alone would wait 10 + 30 s
    (pod / "fractus-pod.yaml").write_text(yaml.safe_dump(config))
    criteria = {**CRITERIA, "probe": {**CRITERIA["probe"], "every": 1000, "parallel": 1,
                                      "timeout_s": 120}}
    (pod / "manifests" / "trusted_loss.yaml").write_text(yaml.safe_dump(criteria))
    plugin, marker = tmp_path / "plugin", tmp_path / "slow-probes"
    plugin.mkdir()
    (plugin / "sitecustomize.py").write_text(SLOW_PROBE)
    monkeypatch.setenv("PYTHONPATH", f"{plugin}:{REPO}")
    monkeypatch.setenv("FRACTUS_TEST_SLOW_PROBE_MARKER", str(marker))
    monkeypatch.setenv("FRACTUS_TEST_SLOW_PROBE_S", "55")
    starts_before = len(events_of(pod, "worker_start"))
    launcher = Launcher(pod, "--gpus", "0")
    launchers.append(launcher)
    start = wait_for(lambda: events_of(pod, "worker_start")[starts_before:], 120,
                     "the worker")[0]
    wait_for(lambda: [e for e in events_of(pod, "probe") if e["ts"] > start["ts"]], 120,
             "the probe of the checkpoint it resumed from (the stage's baseline)")
    wait_for(lambda: [r for r in worker_records(pod, 0)
                      if r.get("type") == "metrics" and r["ts"] > start["ts"]], 120,
             "a training step (so the stop checkpoints, and that checkpoint is probed)")
    marker.touch()                        # from now on a probe takes 55 s

    stopped = fractus_pod(pod, "stop", timeout=240)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert launcher.wait(30) == 0, launcher.output()
    (exit_event,) = [e for e in events_of(pod, "worker_exit") if e["ts"] > start["ts"]]
    assert exit_event["code"] == 0                        # it checkpointed: a final probe
    (final,) = [e for e in events_of(pod, "final_verdicts") if e["ts"] > start["ts"]]
    final_probe = [e for e in events_of(pod, "probe") if e["ts"] > start["ts"]][-1]
    assert final_probe["seconds"] >= 55   # `stop` waited past its own 40 s for this probe
    assert final["ts"] >= final_probe["ts"]


def test_a_stop_right_after_launch_is_never_lost(tmp_path, launchers):
    """Issue 16 item 23. Seen: `fractus-pod stop` 0.3 s after `launch` printed "no launcher
    is running", exited 0, and the launcher then trained on. Here the stop comes at once,
    before the starting launcher can hold the pod: it stops as soon as it does, having
    started no worker."""
    from launcher.cli import main as cli_main
    from tests.support.e2e import make_pod
    fresh = make_pod(tmp_path)
    launcher = Launcher(fresh, "--stage", "1", "--gpus", "0")
    launchers.append(launcher)
    assert cli_main(["--pod-dir", str(fresh), "stop"]) == 0
    assert launcher.wait(300) == 0, launcher.output()
    (stopped,) = events_of(fresh, "launch_stopped")
    assert "fractus-pod stop" in stopped["reason"], stopped
    assert not events_of(fresh, "worker_start")
    assert "pod STOPPED" in launcher.output()
