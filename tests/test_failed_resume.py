"""A relaunch never resumes from a checkpoint marked failed (issue 9, item 6).

Seen: an AR probe failed stage 1, marked the checkpoint failed, and the next launch resumed
from it. End to end here with the real launcher, workers and probes; the launch-time rules
(newest passed, a fresh GPU starts over, nothing intact left refuses) on a pod whose index
and manifest are written by the test.
"""

from __future__ import annotations

import json

import yaml

from launcher.pod.ckpt_index import FAILED, PASSED, CheckpointIndex
from launcher.files import sha256_file
from launcher.cli import main as cli_main
from launcher.pod.manifest import read_manifest
from tests.support.e2e import (TEST_CRITERIA, Launcher, events_of, launchers,  # noqa: F401
                               make_pod)

MANIFEST = "checkpoints/RESUME_MANIFEST_8GPU.json"


def test_a_launch_after_a_failed_probe_resumes_from_the_newest_passed(tmp_path, launchers):
    pod = make_pod(tmp_path, criteria={**TEST_CRITERIA, "probe": {"every": 1, "band": 1e9}})
    first = Launcher(pod, "--stage", "1", "--gpus", "0", "--max-steps", "10")
    launchers.append(first)
    assert first.wait(120) == 0, first.output()
    index = CheckpointIndex(pod)
    passed = [r for r in index.for_gpu(0) if r["verdict"] == PASSED]
    assert passed, "the first run left no passed checkpoint"
    # The next run's probes all fail (baseline AR 0, no noise, floor 0): stage 1 FAILS.
    criteria = pod / "manifests" / "trusted_loss.yaml"
    criteria.write_text(yaml.safe_dump({**TEST_CRITERIA, "probe": {"every": 1, "band": 0.0}}))
    (pod / "logs" / "probe_baselines.json").write_text(json.dumps({"1": {"0": {"ar": 0.0}}}))
    second = Launcher(pod, "--stage", "1", "--gpus", "0", "--max-steps", "10")
    launchers.append(second)
    assert second.wait(120) == 1, second.output()
    verdicts = {r["sha256"]: r for r in CheckpointIndex(pod).for_gpu(0)}
    failed = [r for r in verdicts.values() if r["verdict"] == FAILED]
    assert failed, "the failed probe marked nothing failed"
    entry = read_manifest(pod / MANIFEST).entries[0]
    assert verdicts[entry["checkpoint_sha256"]]["verdict"] == PASSED
    assert entry["start_token"] == max(r["next_token"] for r in passed)
    assert sha256_file(pod / entry["checkpoint"]) == entry["checkpoint_sha256"]
    (restored,) = events_of(pod, "manifest_restored", gpu=0)
    assert restored["to_token"] == entry["start_token"] and "marked failed" in restored["reason"]
    # And the launch after it starts from there, never from a failed checkpoint.
    criteria.write_text(yaml.safe_dump(TEST_CRITERIA))
    third = Launcher(pod, "--stage", "1", "--gpus", "0", "--max-steps", "2")
    launchers.append(third)
    assert third.wait(120) == 0, third.output()
    start = events_of(pod, "worker_start", gpu=0)[-1]
    assert start["start_token"] == entry["start_token"]
    assert start["checkpoint"] == entry["checkpoint"]


def pod_with_history(tmp_path, records: list[tuple[int, str]], named: int):
    """A tiny pod whose GPU 0 wrote checkpoints at the given (token, verdict)s; the
    manifest names the `named`-th one."""
    pod = make_pod(tmp_path)
    index = CheckpointIndex(pod)
    for k, (token, verdict) in enumerate(records):
        path = pod / "checkpoints" / f"ck{k}.pt"
        path.write_bytes(f"checkpoint {k}".encode())
        event = {"sha256": sha256_file(path), "next_token": token, "step": k,
                 "path": f"checkpoints/ck{k}.pt", "ema_tf": 5.0, "lb": 14.0}
        index.add(0, event, 1, event["path"], verdict=verdict, reason=f"test: {verdict}")
    sha = sha256_file(pod / "checkpoints" / f"ck{named}.pt")
    (pod / MANIFEST).write_text(json.dumps({"gpu_0": {
        "start_token": records[named][0], "checkpoint": f"checkpoints/ck{named}.pt",
        "checkpoint_sha256": sha, "stage": 1}}))
    return pod, index


def test_a_fresh_gpu_with_nothing_passed_starts_over(tmp_path, capsys):
    pod, _ = pod_with_history(tmp_path, [(320, FAILED), (640, FAILED)], named=1)
    code = cli_main(["--pod-dir", str(pod), "launch", "--stage", "1", "--gpus", "0",
                     "--max-steps", "1"])
    assert code == 0, capsys.readouterr()
    (restored,) = events_of(pod, "manifest_restored", gpu=0)
    assert restored["to_token"] == 0 and "starts over" in restored["reason"]
    start = events_of(pod, "worker_start", gpu=0)[0]
    assert start["start_token"] == 0 and start["checkpoint"] is None


def test_passed_checkpoints_all_gone_refuses_the_launch(tmp_path, capsys):
    pod, index = pod_with_history(tmp_path, [(320, PASSED), (640, FAILED)], named=1)
    for rel in (index.for_gpu(0)[0]["path"], index.for_gpu(0)[0]["retained"]):
        if rel:
            (pod / rel).unlink()
    before = (pod / MANIFEST).read_bytes()
    code = cli_main(["--pod-dir", str(pod), "launch", "--stage", "1", "--gpus", "0"])
    out = capsys.readouterr()
    assert code == 2
    (line,) = out.err.strip().splitlines()
    assert "gpu_0: the manifest named checkpoints/ck1.pt, marked failed" in line
    assert "no passed checkpoint of it is left intact" in line
    assert (pod / MANIFEST).read_bytes() == before and not events_of(pod, "worker_start")


def test_a_fresh_gpu_that_fails_before_anything_passed_relaunches_at_token_0(tmp_path, capsys):
    """Issue 16 item 22. Seen: NaN on a fresh pod before any checkpoint passed; the failure
    moved the entry to token 0 but the GPU's own file still held the failed checkpoint, so
    the next plain launch named it (v1's default) and refused: "resumes at token 9600 but
    the entry's start_token is 0". The GPU starts over, as documented, with nothing to edit."""
    slow = {**TEST_CRITERIA, "checks": {name: {**spec, "interval": 100, "initialDelay": 100}
                                         if spec.get("interval") else spec
                                         for name, spec in TEST_CRITERIA["checks"].items()}}
    pod = make_pod(tmp_path, criteria=slow)      # the checks vouch for nothing before step 100
    args = ["--pod-dir", str(pod), "launch", "--stage", "1", "--gpus", "0"]
    assert cli_main([*args, "--fault", "0:nan@8"]) == 1, capsys.readouterr()
    failed = [r for r in CheckpointIndex(pod).for_gpu(0) if r["verdict"] == FAILED]
    assert failed and not [r for r in CheckpointIndex(pod).for_gpu(0)
                           if r["verdict"] == PASSED]
    (restored,) = events_of(pod, "manifest_restored", gpu=0)
    assert restored["to_token"] == 0
    entry = read_manifest(pod / MANIFEST).entries[0]
    assert entry.start_token == 0 and entry.checkpoint is None
    capsys.readouterr()
    assert cli_main([*args, "--max-steps", "2"]) == 0, capsys.readouterr()
    start = events_of(pod, "worker_start", gpu=0)[-1]
    assert start["start_token"] == 0 and start["checkpoint"] is None
    done = [r for r in CheckpointIndex(pod).for_gpu(0) if r["next_token"] == 2 * 32]
    assert done, "the relaunch did not train from token 0"
    # The failed bytes are kept aside for a person, under a name nothing resumes from.
    assert "checkpoints/fractus_1b_gpu0.pt" in restored["set_aside"]
    assert (pod / "checkpoints" / "fractus_1b_gpu0.pt.failed").is_file()
