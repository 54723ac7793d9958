"""`status` after the launcher lost its pod files (issue 25, item 24): a metrics file
replaced by a folder fails the pod with advice that fits (not `mv logs.moved logs`), and
`status` shows FAILED and that recorded reason, not "not running" with none, though the
launcher could no longer write its view of the pod.

Real processes: the real launcher and tiny CPU workers, `status` as a child process."""

from __future__ import annotations

import json
import subprocess
import sys

from launcher.pod.events import read_events
from tests.support.e2e import (PROCESS_S, REPO, Launcher, launchers,  # noqa: F401
                               make_pod, wait_for, worker_records)


def test_issue25_status_shows_the_recorded_failure_when_a_metrics_file_became_a_folder(
        tmp_path, launchers):
    pod = make_pod(tmp_path)
    launcher = Launcher(pod, "--stage", "1", "--gpus", "0")
    launchers.append(launcher)
    wait_for(lambda: worker_records(pod, 0, "checkpoint"), PROCESS_S, "a checkpoint on GPU 0")
    metrics = pod / "logs" / "metrics_gpu0.jsonl"
    metrics.rename(pod / "metrics_gpu0.jsonl.kept")
    metrics.mkdir()
    assert launcher.wait(PROCESS_S) == 1, launcher.output()
    (failed,) = [e for e in read_events(pod) if e["event"] == "pod_failed"]
    assert str(metrics) in failed["reason"] and "logs.moved" not in failed["reason"], failed
    # The launcher's last view of the pod (logs/pod_state.json) still says it runs.
    assert json.loads((pod / "logs" / "pod_state.json").read_text())["pod_state"] == "running"
    shown = subprocess.run([sys.executable, "-m", "launcher.cli", "--pod-dir", str(pod),
                            "status", "--json"], cwd=REPO, capture_output=True, text=True,
                           timeout=PROCESS_S)
    assert shown.returncode == 0, shown.stderr
    report = json.loads(shown.stdout)
    assert report["pod_state"] == "FAILED" and report["reason"] == failed["reason"]
    text = subprocess.run([sys.executable, "-m", "launcher.cli", "--pod-dir", str(pod),
                           "status"], cwd=REPO, capture_output=True, text=True,
                          timeout=PROCESS_S, env={"COLUMNS": "400", "PATH": ""})
    # The headline wraps at the terminal's width (the reason holds pytest's temp path, of
    # no fixed length): the reason is there whole once the wrapping is undone.
    assert " ".join(f"reason: {failed['reason']}".split()) in " ".join(text.stdout.split()), \
        text.stdout + text.stderr
