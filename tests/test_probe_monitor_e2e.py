"""The AR probe on a launched pod (issue 6): the real supervisor, worker and probe processes
on a tiny CPU pod. A healthy pod is probed and passes; an AR worse than the recorded
baseline fails the stage, and at stage 2 rolls back past the probed checkpoint. The probe
monitor itself, with a stand-in runner: test_probe_monitor.py.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import yaml

from launcher.checks.health import FAILED, SUCCESSFUL
from launcher.pod.ckpt_index import CheckpointIndex
from tests.support.e2e import (TEST_CRITERIA, Launcher, events_of, launchers,  # noqa: F401
                               make_pod, wait_for)


def record_baseline(pod: Path, stage: int, ar: float) -> None:
    """GPU 0's baseline AR at `stage`, as an earlier probe would have recorded it."""
    (pod / "logs" / "probe_baselines.json").write_text(json.dumps({str(stage): {"0": {"ar": ar}}}))


def stage_one_probed(tmp_path, launchers, band: float, exit_code: int,
                     baseline_ar: float | None = None) -> Path:
    """Launch stage 1 on GPU 0 for 10 steps, every checkpoint probed (within `band` of the
    baseline), and wait for the launcher to exit with `exit_code`: the pod."""
    pod = make_pod(tmp_path, criteria={**TEST_CRITERIA, "probe": {"every": 1, "band": band}})
    if baseline_ar is not None:
        record_baseline(pod, 1, baseline_ar)
    launcher = Launcher(pod, "--stage", "1", "--gpus", "0", "--max-steps", "10")
    launchers.append(launcher)
    assert launcher.wait(120) == exit_code, launcher.output()
    return pod


def test_a_healthy_pod_is_probed_and_passes(tmp_path, launchers):
    pod = stage_one_probed(tmp_path, launchers, band=1e9, exit_code=0, baseline_ar=5.0)
    probes = events_of(pod, "probe", gpu=0)
    # Older checkpoints may be superseded while a probe runs; the newest is always probed.
    assert probes and probes[-1]["step"] == 10, probes
    assert all(p["status"] == SUCCESSFUL and p["baseline_ar"] == 5.0 for p in probes)
    assert all(isinstance(p["ar"], float) and p["ar"] > 0 for p in probes)
    assert not events_of(pod, "check_failed")
    # The pod is not done while a probe runs: every probe was judged before pod_done.
    (done,) = events_of(pod, "pod_done")
    assert all(p["ts"] <= done["ts"] for p in probes)
    # A checkpoint passes once the metrics checks and a probe of it (or a newer one) vouch.
    passed = {r["step"] for r in CheckpointIndex(pod).for_gpu(0) if r["verdict"] == "passed"}
    assert 5 in passed
    assert not list((pod / "checkpoints" / "probe").glob("*.pt"))     # links cleaned up


def test_ar_worse_than_the_recorded_baseline_fails_the_stage(tmp_path, launchers):
    pod = stage_one_probed(tmp_path, launchers, band=0.0, exit_code=1, baseline_ar=0.0)
    (probe,) = events_of(pod, "probe", gpu=0)
    assert probe["status"] == FAILED and probe["baseline_ar"] == 0.0 and probe["ar"] > 0
    (failed,) = events_of(pod, "check_failed", gpu=0)
    assert failed["reason"].startswith("probe: AR ") and "above baseline 0.0000" in failed["reason"]
    assert "probe: AR " in events_of(pod, "pod_failed")[0]["reason"]
    index = CheckpointIndex(pod)
    verdicts = {r["sha256"]: r["verdict"] for r in index.for_gpu(0)}
    assert verdicts[probe["sha256"]] == "failed"        # rollback would never restore it
    assert not (pod / probe["checkpoint"]).exists() or "retained" not in probe["checkpoint"]


def test_a_failed_probe_at_stage_2_rolls_back_past_the_probed_checkpoint(tmp_path, launchers):
    pod = stage_one_probed(tmp_path, launchers, band=1e9, exit_code=0)
    passed = [r for r in CheckpointIndex(pod).for_gpu(0) if r["verdict"] == "passed"]
    assert passed, "stage 1 left no passed checkpoint"
    criteria = pod / "manifests" / "trusted_loss.yaml"
    criteria.write_text(yaml.safe_dump({**TEST_CRITERIA, "probe": {"every": 1, "band": 0.0}}))
    record_baseline(pod, 2, 0.0)
    second = Launcher(pod, "--stage", "2", "--gpus", "0", "--no-canary")
    launchers.append(second)
    wait_for(lambda: events_of(pod, "pod_running", after="rollback"), 120, "the rollback")
    os.killpg(second.proc.pid, signal.SIGTERM)
    assert second.wait(60) == 0, second.output()
    (failed_probe,) = events_of(pod, "probe", gpu=0, stage=2, status=FAILED)
    assert failed_probe["status"] == FAILED
    (rollback,) = events_of(pod, "rollback", gpu=0)
    assert (rollback["from_stage"], rollback["to_stage"]) == (2, 1)
    assert rollback["reason"].startswith("probe: AR ")
    verdicts = {r["sha256"]: r for r in CheckpointIndex(pod).for_gpu(0)}
    assert verdicts[failed_probe["sha256"]]["verdict"] == "failed"
    # Restored: a stage-1 checkpoint older than the one the probe failed.
    assert rollback["to_token"] < verdicts[failed_probe["sha256"]]["next_token"]
