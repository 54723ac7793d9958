"""Data phases end to end: the real launcher and tiny CPU workers on tiny shards, so a
phase ends in a few steps. A GPU that reaches the end of its phase-1 shard goes on at token 0
of phase 2 from its phase-1 checkpoint, the manifest (the user's older layout here) and an
event say so, the GPU whose last phase ends is done, and a kill -9 of the launcher at the
switch resumes to the very same weights as the run that was never interrupted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from launcher.cli import main as cli_main
from launcher.pod.events import read_events
from launcher.worker.process import read_records
from tests.support.worker_utils import write_synth_shard

REPO = Path(__file__).resolve().parents[1]
BATCH, SEQ = 2, 16
TOKENS_PER_STEP = BATCH * SEQ
STEPS = {1: 6, 2: 4}                   # steps each phase's shard holds
SHARDS = {1: "data/shard_gpu{i}.pt", 2: "data/shard_phase2_gpu{i}.npy"}
MANIFEST = "checkpoints/RESUME_MANIFEST_8GPU.json"
# Starts processes (torch import, model build): minutes on a loaded 2-core CI box; the
# waits poll for the fact, so a generous limit costs nothing when it passes.
PROCESS_S = 300
LENIENT = {"checks": {"finite": {"interval": 0}},
           "supervision": {"restarts": {"max_restarts": 3, "window_s": 300, "backoff_s": 0.5,
                                        "backoff_max_s": 2},
                           "hang": {"timeout_s": 120, "startup_timeout_s": 240}}}


def make_pod(root: Path) -> Path:
    """A one-GPU tiny pod with two phases; the manifest in the user's older layout."""
    pod = root / "pod"
    assert cli_main(["--pod-dir", str(pod), "init", "--preset", "tiny-cpu", "--no-data"]) == 0
    tokens = write_synth_shard(pod / "tmp.npy", tokens=STEPS[1] * TOKENS_PER_STEP + 1)
    torch.save(torch.from_numpy(np.load(tokens)), pod / SHARDS[1].format(i=0))  # v1's .pt
    tokens.unlink()
    write_synth_shard(pod / SHARDS[2].format(i=0), tokens=STEPS[2] * TOKENS_PER_STEP + 1,
                      seed=5)
    config = yaml.safe_load((pod / "fractus-pod.yaml").read_text())
    config["env"].update({"SEQ": str(SEQ), "BATCH": str(BATCH)})
    config.update({"devices": "cpu:1", "hub": None, "save_every": 2, "log_every": 1,
                   "poll_interval_s": 0.2, "stop_grace_s": 30.0,
                   "shards": [SHARDS[1], {"shard": SHARDS[2], "name": "phase2"}]})
    (pod / "fractus-pod.yaml").write_text(yaml.safe_dump(config))
    (pod / "manifests" / "trusted_loss.yaml").write_text(yaml.safe_dump(LENIENT))
    (pod / MANIFEST).write_text(json.dumps(
        {"note": "the user's", "gpus": {"0": {"start_token": 0, "tokens_processed": 0,
                                              "last_loss": None}}}, indent=2))
    return pod


def launch(pod: Path) -> subprocess.Popen:
    out = open(pod / "logs" / f"launcher_{time.time_ns()}.out", "w")
    return subprocess.Popen([sys.executable, "-m", "launcher.cli", "--pod-dir", str(pod),
                             "launch", "--stage", "1"], cwd=REPO, stdout=out,
                            stderr=subprocess.STDOUT)


def finish(pod: Path, proc: subprocess.Popen) -> None:
    try:
        assert proc.wait(PROCESS_S) == 0, (pod / "logs").glob("launcher_*.out")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def wait_for(predicate, what: str):
    deadline = time.monotonic() + PROCESS_S
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def events(pod: Path, name: str) -> list[dict]:
    return [e for e in read_events(pod) if e.get("event") == name]


def final_state(pod: Path) -> dict:
    manifest = json.loads((pod / MANIFEST).read_text())
    entry = manifest["gpus"]["0"]
    return torch.load(pod / entry["checkpoint"], map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    pod = make_pod(tmp_path_factory.mktemp("phases"))
    finish(pod, launch(pod))
    return pod


def test_the_gpu_goes_on_to_phase_two_at_token_zero_then_is_done(uninterrupted):
    pod = uninterrupted
    worker = [r for r in read_records(pod / "logs" / "metrics_gpu0.jsonl")
              if r.get("type") == "event"]
    ends = [e for e in worker if e["event"] == "done"]
    assert [(e["reason"], e["phase"], e["next_token"]) for e in ends] == [
        ("end_of_shard", 1, STEPS[1] * TOKENS_PER_STEP),
        ("end_of_shard", 2, STEPS[2] * TOKENS_PER_STEP)]
    phase1_end = [e for e in worker if e["event"] == "checkpoint" and e["phase"] == 1][-1]
    switch, = events(pod, "phase_switch")
    assert (switch["gpu"], switch["from_phase"], switch["to_phase"], switch["start_token"],
            switch["shard"], switch["name"], switch["checkpoint_sha256"]) == \
        (0, 1, 2, 0, SHARDS[2].format(i=0), "phase2", phase1_end["sha256"])
    # Phase 2's worker started at its token 0 from the end of phase 1, step continuing.
    starts = [e for e in worker if e["event"] == "start"]
    assert [(e["next_token"], e["step"], e["settings"]["phase"]) for e in starts] == [
        (0, 0, 1), (0, STEPS[1], 2)]
    assert starts[1]["source"].endswith(phase1_end["path"].split("/")[-1])
    phase2 = [e for e in worker if e["event"] == "checkpoint" and e["phase"] == 2]
    assert phase2[0]["step"] == STEPS[1] + 2 and phase2[0]["next_token"] == 2 * TOKENS_PER_STEP
    assert events(pod, "pod_done")
    # The manifest, in the user's older layout, their fields kept: phase 2, its shard, its end.
    manifest = json.loads((pod / MANIFEST).read_text())
    assert manifest["note"] == "the user's" and list(manifest)[:2] == ["note", "gpus"]
    entry = manifest["gpus"]["0"]
    assert (entry["phase"], entry["shard"], entry["start_token"], entry["tokens_processed"]) \
        == (2, SHARDS[2].format(i=0), STEPS[2] * TOKENS_PER_STEP, STEPS[2] * TOKENS_PER_STEP)
    assert list(entry)[:3] == ["start_token", "tokens_processed", "last_loss"]


def test_status_shows_the_phase_and_its_share_done(uninterrupted, capsys):
    assert cli_main(["status", "--pod-dir", str(uninterrupted), "--json"]) == 0
    row, = json.loads(capsys.readouterr().out)["gpus"]
    assert (row["phase"], row["phases"], row["phase_name"]) == (2, 2, "phase2")
    assert row["shard_pct"] == pytest.approx(100.0 * STEPS[2] * TOKENS_PER_STEP /
                                             (STEPS[2] * TOKENS_PER_STEP + 1))


def test_a_kill_9_at_the_switch_resumes_exactly(uninterrupted, tmp_path):
    pod = make_pod(tmp_path)
    proc = launch(pod)
    try:
        wait_for(lambda: events(pod, "phase_switch"), "the phase switch")
        os.kill(proc.pid, signal.SIGKILL)       # the manifest was just written, not more
        proc.wait()
        # The phase-2 worker it had started gets SIGTERM (its parent-death signal): it ends.
        wait_for(lambda: _no_worker(pod), "its worker to end")
        finish(pod, launch(pod))
    finally:
        if proc.poll() is None:
            proc.kill()
    assert len(events(pod, "phase_switch")) == 1       # switched once, never re-ingested
    ours, theirs = final_state(pod), final_state(uninterrupted)
    assert ours["train_state"]["next_token"] == theirs["train_state"]["next_token"]
    assert ours["train_state"]["step"] == theirs["train_state"]["step"] == sum(STEPS.values())
    for name, tensor in theirs["model_state"].items():
        assert torch.equal(ours["model_state"][name], tensor), name


def _no_worker(pod: Path) -> bool:
    import psutil
    for e in events(pod, "worker_start"):
        try:
            if psutil.Process(e["pid"]).status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.Error:
            continue
    return True
