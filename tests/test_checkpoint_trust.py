"""Which checkpoints a launch trusts (issue 10, items 2, 4, 6, 9, 11): only files inside
the pod that load weights-only as this GPU's checkpoint (its GPU, shard and run, at the
entry's start_token); everything else is refused before anything starts, in one line,
never with torch's advice to load unsafely.

A real tiny pod trained 3 steps by the real worker (tests/support/pods.py), copied per test.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launcher.files import sha256_file
from launcher.cli import main as cli_main
from launcher.pod.events import read_events
from tests.support.trusted_pod import (CKPT, MANIFEST, manifest_of, pod,  # noqa: F401 (fixture)
                                       rewrite_checkpoint, set_entry)
from tests.support.worker_utils import REPO_ROOT, run_worker, worker_env


def launch(pod: Path, capsys) -> tuple[int, str]:
    code = cli_main(["--pod-dir", str(pod), "launch", "--stage", "1", "--gpus", "0",
                     "--max-steps", "1", "--no-canary"])
    return code, capsys.readouterr().err.strip()


def assert_refused(pod: Path, capsys, *words: str) -> str:
    before = (pod / MANIFEST).read_bytes()
    code, err = launch(pod, capsys)
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert "Traceback" not in err and "weights_only=False" not in err
    for word in words:
        assert word in err, err
    assert not [e for e in read_events(pod) if e["event"] == "worker_start"]
    assert (pod / MANIFEST).read_bytes() == before
    assert not (pod / "checkpoints" / "retained").exists()     # nothing linked either
    return err


# ---- item 2: checkpoints resolve inside the pod -----------------------------------------
@pytest.mark.parametrize("how", ["absolute path", "symlink"])
def test_checkpoint_outside_the_pod_is_refused_and_never_linked(pod, tmp_path, capsys, how):
    outside = tmp_path / "elsewhere" / "fractus_1b_gpu0.pt"
    outside.parent.mkdir()
    shutil.copyfile(pod / CKPT, outside)
    if how == "absolute path":
        set_entry(pod, checkpoint=str(outside))
    else:
        (pod / "checkpoints" / "link.pt").symlink_to(outside)
        set_entry(pod, checkpoint="checkpoints/link.pt")
    assert_refused(pod, capsys, "outside the pod")


def test_absolute_path_inside_the_pod_is_accepted(pod):
    from launcher.supervise.plan import load_plan
    from launcher.supervise.prepare import validate
    set_entry(pod, checkpoint=str((pod / CKPT).resolve()))
    plan, manifest = load_plan(pod, 1, None, "0")
    validate(plan, manifest)


# ---- item 6: a checkpoint's identity matches its entry ----------------------------------
IDENTITY_CASES = {
    "another GPU": (lambda ck: ck["train_state"].update(gpu=1), "written by GPU 1"),
    "another shard": (lambda ck: ck["train_state"].update(shard="data/shard_phase2_gpu1.npy"),
                      "trained on shard data/shard_phase2_gpu1.npy"),
    "another run": (lambda ck: ck["train_state"].update(run_id="someone-elses-run"),
                    "belongs to run someone-elses-run"),
}


@pytest.mark.parametrize("case", sorted(IDENTITY_CASES))
def test_checkpoint_of_another_gpu_shard_or_run_is_refused(pod, capsys, case):
    edit, words = IDENTITY_CASES[case]
    data = manifest_of(pod)
    data["run_id"] = "this-run"
    (pod / MANIFEST).write_text(json.dumps(data))
    rewrite_checkpoint(pod, edit)
    assert_refused(pod, capsys, words)


def _strip_identity(ck: dict) -> None:
    for key in ("gpu", "run_id", "shard"):
        ck["train_state"].pop(key, None)
    ck["config"].pop("gpu", None)


def _legacy_weights_only(ck: dict) -> None:
    for key in ("train_state", "optimizer_state"):
        ck.pop(key)
    ck["config"].pop("gpu", None)


@pytest.mark.parametrize("edit", [_strip_identity, _legacy_weights_only])
def test_v1_checkpoints_without_identity_are_accepted(pod, edit):
    from launcher.supervise.plan import load_plan
    from launcher.supervise.prepare import validate
    data = manifest_of(pod)
    data["run_id"] = "this-run"
    (pod / MANIFEST).write_text(json.dumps(data))
    rewrite_checkpoint(pod, edit)
    plan, manifest = load_plan(pod, 1, None, "0")
    validate(plan, manifest)


def test_worker_records_gpu_shard_and_run_in_its_checkpoint(pod):
    ck = torch.load(pod / CKPT, map_location="cpu", weights_only=True)
    assert ck["train_state"]["gpu"] == 0
    assert ck["train_state"]["shard"] == "data/shard_phase2_gpu0.npy"
    assert "run_id" in ck["train_state"]


# ---- item 9: malformed field types, a start_token its checkpoint contradicts ------------
@pytest.mark.parametrize("field, value, words", [
    ("checkpoint", 123, "gpu_0 checkpoint must be a path string, got 123"),
    ("shard", 5, "gpu_0 shard must be a path string, got 5"),
    ("stage", "2", "gpu_0 stage must be an integer >= 1, got '2'"),
    ("checkpoint_sha256", "abc", "checkpoint_sha256 must be a 64-digit hex sha256"),
    ("ema_tf", [1], "ema_tf must be a number"),
])
def test_malformed_field_types_exit_2_with_one_line(pod, capsys, field, value, words):
    set_entry(pod, **{field: value})
    assert_refused(pod, capsys, words)


def test_start_token_that_disagrees_with_its_checkpoint_is_refused_before_start(pod, capsys):
    token = manifest_of(pod)["gpu_0"]["start_token"]
    set_entry(pod, start_token=token - 32)
    assert_refused(pod, capsys, f"resumes at token {token}", f"start_token is {token - 32}")


# ---- items 4 and 11: damaged or malicious files -------------------------------------------
class Payload:
    """Unpickling this would run code (create a marker file): weights_only must refuse."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _malicious(pod: Path, tmp_path: Path) -> Path:
    marker = tmp_path / "payload_ran"
    torch.save({"model_state": {}, "config": Payload(marker)}, pod / CKPT)
    set_entry(pod, checkpoint_sha256=sha256_file(pod / CKPT))
    return marker


def _truncated(pod: Path, tmp_path: Path) -> Path:
    data = (pod / CKPT).read_bytes()
    (pod / CKPT).write_bytes(data[: len(data) // 3])
    set_entry(pod, checkpoint_sha256=sha256_file(pod / CKPT))
    return tmp_path / "no-marker"


@pytest.mark.parametrize("make", [_malicious, _truncated])
def test_corrupt_or_malicious_checkpoint_is_one_line_without_unsafe_advice(pod, tmp_path,
                                                                            capsys, make):
    marker = make(pod, tmp_path)
    err = assert_refused(pod, capsys, "is not usable", "cannot load checkpoint")
    assert "weights_only" not in err.replace("weights-only", "")
    assert not marker.exists()
    # The worker, started by hand on the same file, says the same in one line.
    env = worker_env(pod, CKPT_IN=pod / CKPT, SHARD=pod / "data" / "shard_phase2_gpu0.npy",
                     CKPT_OUT=pod / "checkpoints" / "out.pt", METRICS=pod / "m.jsonl")
    done = run_worker(env, cwd=pod)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot load checkpoint"), lines
    assert "weights_only=False" not in done.stderr and not marker.exists()


def test_damaged_checkpoint_with_no_copy_and_no_hub_is_refused_clearly(pod, capsys):
    with open(pod / CKPT, "r+b") as f:      # in place: every hard link sees the damage
        f.truncate(1000)
    assert_refused(pod, capsys, "holds other bytes", "no local copy or hub revision")


# ---- item 11: no phantom GPU in status ---------------------------------------------------
def test_manifest_entry_for_a_gpu_the_pod_does_not_run_is_no_phantom_in_status(pod):
    data = manifest_of(pod)
    data["gpu_7"] = {"start_token": 0}
    (pod / MANIFEST).write_text(json.dumps(data))
    status = subprocess.run([sys.executable, "-m", "launcher.cli", "--pod-dir", str(pod),
                             "status", "--json"], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=60)
    report = json.loads(status.stdout)
    assert [row["gpu"] for row in report["gpus"]] == [0, 1]
    assert report["manifest_unrun_gpus"] == [7]
    text = subprocess.run([sys.executable, "-m", "launcher.cli", "--pod-dir", str(pod),
                           "status"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert "manifest also lists gpu_7" in text.stdout
    assert json.loads((pod / MANIFEST).read_text())["gpu_7"] == {"start_token": 0}   # kept
