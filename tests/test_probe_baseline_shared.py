"""One baseline for a GPU's stage, found by the launcher's probes and by `fractus-pod probe
--gpu` alike (launcher/checks/probe_outcome.py, stage_baseline): a launch that set the
baseline from its own probe leaves `probe --gpu` judging against that same number."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from launcher.checks.probe_outcome import BASELINE, stage_baseline
from tests.support.e2e import (TEST_CRITERIA, Launcher, events_of, launchers,  # noqa: F401
                               make_pod)

REPO = Path(__file__).resolve().parents[1]


def test_probe_gpu_judges_against_the_baseline_the_launchers_probes_set(tmp_path, launchers):
    pod = make_pod(tmp_path, criteria={**TEST_CRITERIA, "probe": {"every": 1, "band": 1e9}})
    launcher = Launcher(pod, "--stage", "1", "--gpus", "0", "--max-steps", "6")
    launchers.append(launcher)
    assert launcher.wait(120) == 0, launcher.output()
    assert not (pod / "logs" / "probe_baselines.json").exists()     # nothing recorded
    set_by_launcher = events_of(pod, "probe", gpu=0, status=BASELINE)[-1]
    judged = [p for p in events_of(pod, "probe", gpu=0) if p["status"] != BASELINE]
    # (its later probes, if a newer checkpoint came while the first ran, were judged on it)
    assert {p["baseline_ar"] for p in judged} <= {set_by_launcher["ar"]}

    done = subprocess.run([sys.executable, "-m", "launcher.cli", "--pod-dir", str(pod),
                           "probe", "--gpu", "0", "--json"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["baseline_ar"] == set_by_launcher["ar"], report
    assert report["baseline_source"] == "set by the launcher's probes at stage 1"
    assert report["verdict"] == "Successful" and "hint" not in report


def test_a_baseline_is_found_only_for_its_stage_gpu_and_shard(tmp_path):
    from launcher.pod.events import EventLog
    events = EventLog(tmp_path)
    shard = "data/shard_gpu0.npy"
    common = {"gpu": 0, "role": "baseline", "status": BASELINE, "shard": shard}
    events.emit("probe", stage=2, **common, ar=5.0, ar_rows=[4.9, 5.1])
    events.emit("probe", stage=2, **common, ar=4.0, ar_rows=[3.9, 4.1])   # the newest wins
    events.emit("probe", stage=2, **{**common, "status": "Successful"}, ar=9.0)
    events.emit("probe", stage=2, **{**common, "shard": "data/other.npy"}, ar=7.0)
    baseline, source = stage_baseline(tmp_path, 2, 0, tmp_path / shard)
    assert baseline.ar == 4.0 and baseline.ar_rows == (3.9, 4.1)
    assert source == "set by the launcher's probes at stage 2"
    assert stage_baseline(tmp_path, 3, 0, shard) is None
    assert stage_baseline(tmp_path, 2, 1, shard) is None
    assert stage_baseline(tmp_path, 2, 0, "data/elsewhere.npy") is None
    # one recorded by hand wins
    (tmp_path / "logs" / "probe_baselines.json").write_text(json.dumps({"2": {"0": {"ar": 3}}}))
    assert stage_baseline(tmp_path, 2, 0, shard) == (stage_baseline(tmp_path, 2, 0, shard)[0],
                                                     "recorded for stage 2")
    assert stage_baseline(tmp_path, 2, 0, shard)[0].ar == 3.0
