"""Paths a new user takes through the CLI (issue 10, items 13, 18, 20, 22, 23, 24).

Real processes: `python -m launcher.cli` as a child process; the launched pod is trained by
the real launcher and real tiny CPU workers (tests/test_launch_canary.py's fixture: 3 steps
at stage 1 on GPU 0, each test works on a copy).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from tests.support.canary_pod import pod  # noqa: F401 (fixture: a launched pod)
from tests.support.e2e import (REPO, Launcher, events_of, launchers,  # noqa: F401
                               manifest_json, wait_for)


def fractus_pod(*args: str, cwd: Path = REPO, timeout: float = 180):
    return subprocess.run([sys.executable, "-m", "launcher.cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


def one_error_line(done) -> str:
    """A user mistake: exit 2, one line on stderr with the `error:` prefix, no traceback."""
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    return lines[0]


# ---- 20: --pod-dir after the subcommand ------------------------------------------------
def test_pod_dir_is_accepted_after_the_subcommand(tmp_path):
    pod = tmp_path / "late"
    done = fractus_pod("init", "--preset", "tiny-cpu", "--no-data", "--pod-dir", str(pod))
    assert done.returncode == 0, done.stderr
    assert (pod / "fractus-pod.yaml").is_file()
    status = fractus_pod("status", "--json", "--pod-dir", str(pod))
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["pod_dir"] == str(pod.resolve())
    history = fractus_pod("sync", "history", "--pod-dir", str(pod))
    assert history.returncode == 0, history.stderr
    # After the subcommand it wins over the group's (and $FRACTUS_POD_DIR's) value.
    elsewhere = fractus_pod("--pod-dir", str(tmp_path / "nowhere"), "status", "--json",
                            "--pod-dir", str(pod))
    assert elsewhere.returncode == 0, elsewhere.stderr


# ---- 24: one error prefix -----------------------------------------------------------------
def test_every_error_has_the_same_prefix(tmp_path):
    pod = tmp_path / "pod"
    assert fractus_pod("--pod-dir", str(pod), "init", "--no-data").returncode == 0
    usage = one_error_line(fractus_pod("status", "--no-such-option", "--pod-dir", str(pod)))
    assert "--no-such-option" in usage and "fractus-pod status --help" in usage
    missing = one_error_line(fractus_pod("stop", "--pod-dir", str(tmp_path / "absent")))
    assert "fractus-pod init" in missing
    # A failure that is not the user's (exit 1: a store whose commit record is corrupt)
    # carries the same prefix.
    head = "a" * 64
    (pod / "hub" / "refs").mkdir(parents=True)
    (pod / "hub" / "refs" / "main").write_text(head)
    (pod / "hub" / "commits").mkdir()
    (pod / "hub" / "commits" / f"{head}.json").write_text("{}")
    hub_error = fractus_pod("--pod-dir", str(pod), "sync", "pull")
    assert hub_error.returncode == 1, hub_error.stdout + hub_error.stderr
    assert hub_error.stderr.startswith("error: ") and "Error:" not in hub_error.stderr


# ---- 22: init --force keeps the user's stage and criteria files --------------------------
def test_init_force_keeps_the_users_manifest_edits_and_says_so(tmp_path):
    pod = tmp_path / "pod"
    assert fractus_pod("--pod-dir", str(pod), "init", "--no-data").returncode == 0
    stages = pod / "manifests" / "stages.yaml"
    edited = stages.read_text() + "# tuned by hand\n"
    stages.write_text(edited)
    criteria_before = (pod / "manifests" / "trusted_loss.yaml").read_bytes()
    done = fractus_pod("--pod-dir", str(pod), "init", "--preset", "1b-8gpu", "--force",
                       "--no-data")
    assert done.returncode == 0, done.stderr
    assert stages.read_text() == edited
    assert (pod / "manifests" / "trusted_loss.yaml").read_bytes() == criteria_before
    assert "kept manifests/stages.yaml" in done.stdout
    assert "kept manifests/trusted_loss.yaml" in done.stdout
    assert yaml.safe_load((pod / "fractus-pod.yaml").read_text())["model"] == "1b"


# ---- 23: init --preset 1b-8gpu gives a next step that works ------------------------------
def test_init_1b_names_the_missing_shards_and_the_fix(tmp_path):
    pod = tmp_path / "big"
    done = fractus_pod("--pod-dir", str(pod), "init", "--preset", "1b-8gpu")
    assert done.returncode == 0, done.stderr
    (next_line,) = [line for line in done.stdout.splitlines() if line.startswith("next:")]
    for i in range(8):
        assert f"data/shard_phase2_gpu{i}.npy" in next_line
    assert "shards:" in next_line and "launch --stage N" in next_line and "1 to 5" in next_line
    # The launch the hint leads to says the same: every missing shard, and the fix.
    refused = one_error_line(fractus_pod("--pod-dir", str(pod), "launch", "--stage", "1",
                                         "--devices", "cpu:2"))
    assert "data/shard_phase2_gpu0.npy" in refused and "data/shard_phase2_gpu1.npy" in refused
    assert "shards:" in refused
    # Following it (shards in place) gets past the check: the tiny preset has them.
    small = tmp_path / "small"
    done = fractus_pod("--pod-dir", str(small), "init")
    assert done.returncode == 0 and "shard(s) missing" not in done.stdout
    assert done.stdout.strip().splitlines()[-1].startswith("next: fractus-pod")


# ---- 13: rollback only goes down -----------------------------------------------------
def test_rollback_above_the_pods_stage_is_refused_and_changes_nothing(pod):
    before = (pod / "checkpoints" / "RESUME_MANIFEST_8GPU.json").read_bytes()
    events_before = len(events_of(pod, "stage_change"))
    refused = one_error_line(fractus_pod("--pod-dir", str(pod), "rollback", "--to-stage", "3"))
    assert "only goes down" in refused and "launch --stage 3" in refused
    assert (pod / "checkpoints" / "RESUME_MANIFEST_8GPU.json").read_bytes() == before
    assert len(events_of(pod, "stage_change")) == events_before
    # Down (or to the same stage) still works.
    done = fractus_pod("--pod-dir", str(pod), "rollback", "--to-stage", "1", "--gpu", "0")
    assert done.returncode == 0, done.stderr
    assert manifest_json(pod)["gpu_0"]["stage"] == 1


def test_rollback_above_the_running_launchers_stage_is_refused(pod, launchers):
    launcher = Launcher(pod, "--gpus", "0")
    launchers.append(launcher)
    state = pod / "logs" / "pod_state.json"
    wait_for(lambda: state.exists() and json.loads(state.read_text())["pod_state"] == "running"
             and json.loads(state.read_text())["started_at"] > manifest_json(pod)["gpu_0"]
             ["updated_at"], 120, "the launcher running")
    refused = one_error_line(fractus_pod("--pod-dir", str(pod), "rollback", "--to-stage", "2"))
    assert "only goes down" in refused
    assert not (pod / "logs" / "rollback_request.json").exists()   # nothing asked of it
    assert fractus_pod("--pod-dir", str(pod), "stop").returncode == 0
    assert launcher.wait(60) == 0
    assert manifest_json(pod)["gpu_0"]["stage"] == 1


def test_rollback_on_a_pod_never_launched_is_refused(tmp_path):
    pod = tmp_path / "fresh"
    assert fractus_pod("--pod-dir", str(pod), "init", "--no-data").returncode == 0
    refused = one_error_line(fractus_pod("--pod-dir", str(pod), "rollback", "--to-stage", "4"))
    assert "launch --stage" in refused


# ---- 18: status words agree on a stopped pod ----------------------------------------------
def test_status_of_a_stopped_pod_does_not_say_running(pod):
    done = fractus_pod("--pod-dir", str(pod), "status", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["pod_state"] == "not running"
    (gpu0,) = [r for r in report["gpus"] if r["gpu"] == 0]
    assert gpu0["state"] == "not running"
    assert gpu0["verdict"] == "Incomplete" and "stopped" in gpu0["reason"]
    table = fractus_pod("--pod-dir", str(pod), "status")
    assert table.returncode == 0, table.stderr
    assert "Running" not in table.stdout and "RUNNING" not in table.stdout
