"""The launcher's hub sync against the protocol-level test hub, through the real HfApi.

Real processes: the launcher and two tiny CPU workers; the launcher's HfApi talks to the
test hub on loopback (HF_ENDPOINT, HF_TOKEN and HF_HUB_DISABLE_XET come from the fixture).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import HfApi

from tests.support.e2e import (PROCESS_S, REPO, Launcher, events_of, launchers,  # noqa: F401
                               make_pod, manifest_json, wait_for, worker_records)
from tests.support.hf_client import REPO_ID, assert_no_token, quiet_hf_client  # noqa: F401
from tests.support.hub_pod import CKPT, FAST_PASS, MANIFEST
from tests.support.hub_server import test_hub  # noqa: F401  (pytest fixture)

pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")


def status_output(pod: Path, *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "launcher.cli", "--pod-dir", str(pod), "status",
                          *args], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout + out.stderr


def passed_checkpoints(pod: Path) -> set[tuple[int, str]]:
    lines = (pod / "logs" / "checkpoints.jsonl").read_text().splitlines()
    return {(r["gpu"], r["sha256"]) for r in map(json.loads, lines) if r["verdict"] == "passed"}


def test_interval_and_stop_pushes_are_single_commits_of_passed_checkpoints(
        test_hub, tmp_path, launchers):
    pod = make_pod(tmp_path, criteria=FAST_PASS, hub=f"hf://{REPO_ID}",
                   sync={"interval": 3, "attempts": 3, "backoff_s": 0.2,
                         "commits_per_hour": 3600})
    launcher = Launcher(pod, "--stage", "1")
    launchers.append(launcher)
    # Stopped once an interval push landed (CI under load: a fixed --max-time 18 ended some
    # runs before any checkpoint had passed, so no interval push was ever due).
    wait_for(lambda: [p for p in events_of(pod, "sync_pushed") if p["reason"] == "interval"],
             PROCESS_S, "an interval push")
    os.killpg(launcher.proc.pid, signal.SIGTERM)
    assert launcher.wait(150) == 0, launcher.output()

    pushes = events_of(pod, "sync_pushed")
    reasons = [p["reason"] for p in pushes]
    assert "interval" in reasons and reasons[-1] == "stop" and reasons.count("stop") == 1
    # One commit per push and nothing else (after the repo's own initial commit): the hub's
    # record and the client's listing agree.
    *commits, initial = test_hub.commits(REPO_ID)           # newest first
    assert initial.title == "initial commit" and MANIFEST not in initial.tree
    revisions = [p["revision"] for p in reversed(pushes)]
    assert [c.oid for c in commits] == revisions
    listed = HfApi(endpoint=test_hub.url).list_repo_commits(REPO_ID)
    assert [c.commit_id for c in listed[:-1]] == revisions
    assert len(test_hub.routed("commit", "POST")) == len(pushes)

    passed = passed_checkpoints(pod)
    for commit, push in zip(commits, reversed(pushes)):
        doc = json.loads(commit.tree[MANIFEST].content)
        # An early interval push may precede a GPU's first passed checkpoint: it then holds
        # only the GPUs that have one.
        gpus = [gpu for gpu in (0, 1) if CKPT.format(gpu) in commit.tree]
        assert gpus, f"commit {commit.oid} holds no checkpoint"
        for gpu in gpus:
            blob = commit.tree[CKPT.format(gpu)]
            # Each commit's manifest names exactly the checkpoint bytes of that commit ...
            assert blob.sha256 == doc[f"gpu_{gpu}"]["checkpoint_sha256"]
            assert doc[f"gpu_{gpu}"]["start_token"] == push["tokens"][str(gpu)]
            # ... and only checkpoints whose verdict is passed went up.
            assert (gpu, blob.sha256) in passed
    # The stop push carried both GPUs' final checkpoints, in that one commit.
    stop, before = commits[0], commits[1]
    for gpu in (0, 1):
        name = CKPT.format(gpu)
        assert name in stop.tree
        if name in before.tree:
            assert stop.tree[name].sha256 != before.tree[name].sha256
    manifest = manifest_json(pod)
    for gpu in (0, 1):
        assert manifest[f"gpu_{gpu}"]["hub_revision"] == pushes[-1]["revision"]
        assert manifest[f"gpu_{gpu}"]["checkpoint_sha256"] == \
            stop.tree[CKPT.format(gpu)].sha256

    as_json = json.loads(status_output(pod, "--json"))
    assert as_json["sync"]["last_revision"] == pushes[-1]["revision"]
    assert as_json["sync"]["last_error"] is None
    plain = status_output(pod)
    assert pushes[-1]["revision"][:12] in plain
    for gpu in (0, 1):   # how far the hub's copy of each GPU goes
        assert f"gpu{gpu}@{manifest[f'gpu_{gpu}']['start_token']:,}" in plain
    assert_no_token(pod, texts=(plain, json.dumps(as_json), launcher.output()))


def test_failing_hub_does_not_stop_training_and_a_later_sync_succeeds(
        test_hub, tmp_path, launchers):
    pod = make_pod(tmp_path, criteria=FAST_PASS, hub=f"hf://{REPO_ID}",
                   sync={"interval": 2, "attempts": 2, "backoff_s": 0.1,
                         "commits_per_hour": 3600})
    # repo_info: a call the client does not retry itself (its own backoff on preupload and
    # commit would spend ~23 s per failing call before the store even sees it).
    test_hub.faults.add("repo_info", "status", count=100_000, status=500)
    launcher = Launcher(pod, "--stage", "1", "--max-time", "90")
    launchers.append(launcher)

    failed = wait_for(lambda: events_of(pod, "sync_failed"), 90, "a failed sync")[0]
    assert "500" in failed["error"]
    as_json = json.loads(status_output(pod, "--json"))
    assert as_json["pod_state"] == "RUNNING"
    assert "500" in as_json["sync"]["last_error"] and as_json["sync"]["last_revision"] is None
    plain = status_output(pod)
    assert "hub last error" in plain and "500" in plain
    # Training went on past the failure, without restarts.
    for gpu in (0, 1):
        wait_for(lambda: [r for r in worker_records(pod, gpu) if r.get("type") == "metrics"
                          and r["ts"] > failed["ts"] + 1], 30, f"GPU {gpu} training on")

    test_hub.faults.clear()
    ok = wait_for(lambda: [e for e in events_of(pod, "sync_pushed") if e["ts"] > failed["ts"]],
                  60, "a successful sync after the failures")[0]
    later = json.loads(status_output(pod, "--json"))
    assert later["sync"]["last_revision"] in [e["revision"] for e in events_of(pod, "sync_pushed")
                                              if e["ts"] >= ok["ts"]]
    assert later["sync"]["last_result"] == "ok" and "500" in later["sync"]["last_error"]
    assert test_hub.commits(REPO_ID)[0].oid in {e["revision"] for e in
                                                events_of(pod, "sync_pushed")}
    os.killpg(launcher.proc.pid, signal.SIGTERM)
    assert launcher.wait(60) == 0, launcher.output()
    assert not events_of(pod, "worker_crash") and not events_of(pod, "pod_failed")
    assert events_of(pod, "sync_pushed")[-1]["reason"] == "stop"
    assert_no_token(pod, texts=(plain, json.dumps(as_json), json.dumps(later),
                                launcher.output()))


def test_second_signal_abandons_a_final_push_stuck_on_a_failing_hub(test_hub, tmp_path,
                                                                    launchers):
    pod = make_pod(tmp_path, criteria=FAST_PASS, hub=f"hf://{REPO_ID}",
                   sync={"interval": 3600, "attempts": 5, "backoff_s": 1})
    # Every commit fails: the client's own backoff and the store's retries would hold the
    # launcher for minutes at its final push.
    test_hub.faults.add("commit", "status", count=100_000, status=503)
    launcher = Launcher(pod, "--stage", "1", "--max-steps", "6")
    launchers.append(launcher)
    wait_for(lambda: "final push" in launcher.output(), 120, "the final push to start")
    wait_for(lambda: test_hub.routed("commit"), 30, "a commit attempt")
    os.killpg(launcher.proc.pid, signal.SIGTERM)
    assert launcher.wait(20) == 0, launcher.output()
    (failed,) = events_of(pod, "sync_failed")
    assert failed["reason"] == "stop" and "abandoned" in failed["error"]
    state = json.loads((pod / "logs" / "sync_state.json").read_text())
    assert state["in_flight"] is False and "abandoned" in state["last_error"]
    manifest = manifest_json(pod)      # the pod itself is intact: resumable where it stopped
    for gpu in (0, 1):
        assert manifest[f"gpu_{gpu}"]["start_token"] == \
            worker_records(pod, gpu, "checkpoint")[-1]["next_token"]
        assert "hub_revision" not in manifest[f"gpu_{gpu}"]
