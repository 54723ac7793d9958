"""End to end, pod-level safety: a killed launcher takes its workers down and a relaunch
resumes exactly; a failure at stage 1 stops the pod FAILED; a busy GPU or a malformed
manifest refuses the launch with nothing started.

Uses the pod helpers of tests/support/e2e.py (real launcher, real tiny CPU workers).
"""

import os
import subprocess
import sys
import time

import psutil
import pytest

from launcher.cli import main as cli_main
from tests.support.e2e import (REPO, TOKENS_PER_STEP, Launcher, events_of, launchers,
                               make_pod, manifest_json, wait_for, worker_records)

__all__ = ["launchers"]   # the fixture, imported for pytest


def test_killed_launcher_takes_workers_down_and_relaunch_resumes_exactly(tmp_path, launchers):
    pod = make_pod(tmp_path)
    first = Launcher(pod, "--stage", "2")
    launchers.append(first)
    for gpu in (0, 1):
        wait_for(lambda: len(worker_records(pod, gpu, "checkpoint")) >= 2, 90, "checkpoints")
    pids = [e["pid"] for e in events_of(pod, "worker_start")]
    killed_at = time.time()
    first.proc.kill()                                       # SIGKILL: no cleanup at all
    first.proc.wait()

    def all_gone():
        return not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
                       for p in pids)
    wait_for(all_gone, 30, "the workers to stop with their launcher")
    for gpu in (0, 1):   # they checkpointed on the way out (SIGTERM from the kernel)
        assert worker_records(pod, gpu, "done")[-1]["reason"] == "signal"

    second = Launcher(pod, "--stage", "2", "--max-steps", "3")
    launchers.append(second)
    assert second.wait(120) == 0, second.output()
    for gpu in (0, 1):
        records = worker_records(pod, gpu)
        starts = [i for i, r in enumerate(records) if r.get("event") == "start"]
        assert len(starts) == 2
        before = [r for r in records[:starts[1]] if r.get("event") == "checkpoint"]
        # Resumed exactly at the last checkpoint: no token skipped, none trained twice.
        assert records[starts[1]]["next_token"] == before[-1]["next_token"]
        if before[-1]["ts"] > killed_at:     # written after its launcher died: adopted
            (adopted,) = events_of(pod, "manifest_reconciled", gpu=gpu)
            assert adopted["start_token"] == before[-1]["next_token"]
        assert manifest_json(pod)[f"gpu_{gpu}"]["start_token"] == \
            before[-1]["next_token"] + 3 * TOKENS_PER_STEP


def test_worker_already_running_on_a_gpu_is_refused(tmp_path, capsys):
    pod = make_pod(tmp_path)
    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",
                                 "-m", "fractus.train.worker"], cwd=pod,
                                env={**os.environ, "GPU_ID": "1"})
    try:
        wait_for(lambda: psutil.Process(stand_in.pid).cwd() == str(pod.resolve()), 10, "stand-in")
        code = cli_main(["--pod-dir", str(pod), "launch", "--stage", "1"])
        err = capsys.readouterr().err
        assert code == 2 and "already runs on GPU 1" in err
        assert not events_of(pod, "worker_start")
    finally:
        stand_in.kill()
        stand_in.wait()


def test_failure_at_stage_1_stops_the_pod_failed_without_rollback(tmp_path, launchers):
    pod = make_pod(tmp_path)
    launcher = Launcher(pod, "--stage", "1", "--fault", "0:nan@8")
    launchers.append(launcher)
    assert launcher.wait(120) == 1, launcher.output()
    (failed,) = events_of(pod, "pod_failed")
    assert "stage 1 failed" in failed["reason"] and "finite" in failed["reason"]
    assert not events_of(pod, "rollback")
    # GPU 0 keeps its last good resume point; GPU 1 stopped gracefully with a checkpoint.
    manifest = manifest_json(pod)
    assert manifest["gpu_0"]["start_token"] == 5 * TOKENS_PER_STEP
    # Under load GPU 1 may still be starting when GPU 0 fails: a stop before its first step
    # leaves nothing to resume from, so the manifest must not invent an entry for it.
    trained = [c for c in worker_records(pod, 1, "checkpoint") if c.get("ema_tf") is not None]
    if trained:
        assert manifest["gpu_1"]["start_token"] == trained[-1]["next_token"]
    else:
        assert "gpu_1" not in manifest
    status = subprocess.run([sys.executable, "-m", "launcher.cli", "--pod-dir", str(pod),
                             "status", "--json"], cwd=REPO, capture_output=True, text=True,
                            timeout=60)
    assert '"pod_state": "FAILED"' in status.stdout


def _good_checkpoint(pod) -> str:
    """A real file for manifests that name a checkpoint (validation only checks it exists)."""
    path = pod / "checkpoints" / "fractus_1b_gpu0.pt"
    path.write_bytes(b"not used: launch refuses before reading it")
    return "checkpoints/fractus_1b_gpu0.pt"


MALFORMED = {
    "negative start_token": '{"gpu_0": {"start_token": -5}}',
    "non-integer start_token": '{"gpu_0": {"start_token": 12.5}}',
    "string start_token": '{"gpu_0": {"start_token": "1200"}}',
    "past the shard end": '{"gpu_0": {"start_token": 10000000, "checkpoint": "CKPT"}}',
    "GPU listed twice (two spellings)": '{"gpu_1": {"start_token": 0}, "gpu_01": {"start_token": 0}}',
    "GPU listed twice (both layouts)": '{"gpu_0": {"start_token": 0}, "gpus": {"0": {"start_token": 0}}}',
    "GPU listed twice (same key)": '{"gpu_0": {"start_token": 0}, "gpu_0": {"start_token": 64}}',
    "missing checkpoint file": '{"gpu_0": {"start_token": 64, "checkpoint": "checkpoints/gone.pt"}}',
    "invalid JSON": '{"gpu_0": {"start_token": 64,}',
}
EXPECTED_WORDS = {
    "negative start_token": "negative", "non-integer start_token": "integer",
    "string start_token": "integer", "past the shard end": "past the end",
    "GPU listed twice (two spellings)": "listed twice",
    "GPU listed twice (both layouts)": "listed twice", "GPU listed twice (same key)": "twice",
    "missing checkpoint file": "does not exist", "invalid JSON": "invalid JSON",
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_manifest_exits_2_with_one_line_and_starts_nothing(tmp_path, capsys, case):
    pod = make_pod(tmp_path)
    manifest = pod / "checkpoints" / "RESUME_MANIFEST_8GPU.json"
    manifest.write_text(MALFORMED[case].replace("CKPT", _good_checkpoint(pod)))
    before = manifest.read_bytes()
    code = cli_main(["--pod-dir", str(pod), "launch", "--stage", "1"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and err.startswith("error: ")
    assert EXPECTED_WORDS[case] in err and "Traceback" not in err
    assert not events_of(pod, "worker_start")
    assert not list((pod / "logs").glob("metrics_gpu*.jsonl"))
    assert manifest.read_bytes() == before                    # nothing rewritten either


def test_cli_process_reports_malformed_manifest_without_traceback(tmp_path):
    pod = make_pod(tmp_path)
    (pod / "checkpoints" / "RESUME_MANIFEST_8GPU.json").write_text(MALFORMED["invalid JSON"])
    done = subprocess.run([sys.executable, "-m", "launcher.cli", "--pod-dir", str(pod),
                           "launch", "--stage", "1"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.startswith("error: manifest") and "Traceback" not in done.stderr
    assert done.stdout == ""
