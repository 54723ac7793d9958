"""`fractus-pod probe`: the AR probe of a GPU's newest checkpoint, run by the real CLI.

The pod (a copy per module of tests/conftest.py's worker_trained_pod): `init --preset
tiny-cpu`, one synthetic shard, 3 steps trained at stage 1 by the real worker, the manifest
written from its checkpoint event.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fractus.eval.probe import probe_checkpoint
from launcher.pod.manifest import read_manifest
from launcher.config.podconfig import load_pod_config

from tests.support.pods import copy_pod

REPO = Path(__file__).resolve().parents[1]
NUMBERS = ("ar", "ar_acc", "cold_tf", "start", "rows", "next_token")


def fractus_pod(pod: Path, *args: str):
    return subprocess.run([sys.executable, "-m", "launcher.cli", "--pod-dir", str(pod), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def pod(worker_trained_pod, tmp_path_factory) -> Path:
    return copy_pod(worker_trained_pod, tmp_path_factory.mktemp("pod") / "pod")


def probe_json(pod: Path, *args: str) -> dict:
    done = fractus_pod(pod, "probe", "--json", *args)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_probe_gpu_prints_the_numbers_of_its_checkpoint_and_repeats_them(pod):
    first, second = probe_json(pod, "--gpu", "0"), probe_json(pod, "--gpu", "0")
    assert {k: first[k] for k in NUMBERS} == {k: second[k] for k in NUMBERS}
    entry = read_manifest(pod / load_pod_config(pod).manifest).entries[0]
    assert Path(first["checkpoint"]) == pod / entry["checkpoint"]
    assert Path(first["shard"]) == pod / entry["shard"]
    assert first["next_token"] == entry["start_token"] and first["stage"] == 1
    # The same numbers as the probe run in this process on that checkpoint and shard.
    here = probe_checkpoint(pod / entry["checkpoint"], pod / entry["shard"])
    assert (first["ar"], first["ar_acc"], first["cold_tf"]) == \
        pytest.approx((here.ar, here.ar_acc, here.cold_tf), rel=1e-6)
    assert "verdict" not in first                       # no baseline, no verdict
    # --checkpoint/--shard probe the same files to the same numbers.
    direct = probe_json(pod, "--checkpoint", entry["checkpoint"], "--shard", entry["shard"])
    assert direct["ar"] == first["ar"] and direct["gpu"] is None


def test_probe_verdict_against_a_baseline(pod):
    ar = probe_json(pod, "--gpu", "0")["ar"]
    ok = fractus_pod(pod, "probe", "--gpu", "0", "--baseline-ar", str(ar))
    assert ok.returncode == 0 and "Successful: AR" in ok.stdout, ok.stdout + ok.stderr
    # The tiny preset lets AR rise by up to its baseline (relativeBand 1.0): go well past it.
    worse = fractus_pod(pod, "probe", "--gpu", "0", "--baseline-ar", str(ar / 4))
    assert worse.returncode == 1 and "Failed: AR" in worse.stdout
    # A recorded baseline for the GPU's stage is used when none is given.
    recorded = probe_json(pod, "--gpu", "0", "--record-baseline")
    assert recorded["recorded_baseline"]
    again = probe_json(pod, "--gpu", "0")
    assert again["baseline_ar"] == ar and again["verdict"] == "Successful"
    assert again["baseline_source"] == "recorded for stage 1"
    (pod / "logs" / "probe_baselines.json").unlink()     # the module's pod, for other tests


def test_no_baseline_gives_a_hint_and_recording_one_is_confirmed(pod):
    """Issue 10 item 21: no verdict without a baseline, but a hint how to get one."""
    bare = fractus_pod(pod, "probe", "--gpu", "0")
    assert bare.returncode == 0, bare.stderr
    assert "AR=" in bare.stdout and "Failed" not in bare.stdout and "Successful" not in bare.stdout
    assert "no baseline for GPU 0 at stage 1, so no verdict" in bare.stdout
    assert "fractus-pod probe --gpu 0 --record-baseline" in bare.stdout
    assert probe_json(pod, "--gpu", "0")["hint"].startswith("no baseline for GPU 0 at stage 1")
    recorded = fractus_pod(pod, "probe", "--gpu", "0", "--record-baseline")
    assert recorded.returncode == 0, recorded.stderr
    ar = json.loads((pod / "logs" / "probe_baselines.json").read_text())["1"]["0"]["ar"]
    assert f"recorded AR {ar:.4f} as the baseline of GPU 0 at stage 1" in recorded.stdout
    assert "logs/probe_baselines.json" in recorded.stdout and "no baseline" not in recorded.stdout
    judged = fractus_pod(pod, "probe", "--gpu", "0")
    assert "Successful: AR" in judged.stdout and "no baseline" not in judged.stdout
    (pod / "logs" / "probe_baselines.json").unlink()     # the module's pod, for other tests


@pytest.mark.parametrize("args, message", [
    (("--gpu", "9"), "no GPU 9"),
    (("--gpu", "1"), "has no checkpoint"),
    (("--checkpoint", "checkpoints/nope.pt", "--shard", "data/shard_phase2_gpu0.npy"),
     "checkpoint not found"),
    (("--checkpoint", "checkpoints/fractus_1b_gpu0.pt"), "needs --shard"),
    (("--gpu", "0", "--shard", "data/nope.npy"), "shard not found"),
])
def test_bad_input_is_one_line_and_exit_2(pod, args, message):
    done = fractus_pod(pod, "probe", *args)
    assert done.returncode == 2, done.stdout + done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert message in line and done.stdout == ""


def test_a_checkpoint_without_a_train_head_is_probed_where_the_output_says(pod):
    """Issue 16 item 3: `probe --checkpoint MERGED.pt --shard data/shard...` on the merged
    brain (no train head) exited 2 "no train head ... pass --head", an option the pod
    command did not have. Now: the manifest head of the GPU training on that shard, said;
    --head chooses; a shard no GPU trains on starts at 0."""
    import torch
    entry = read_manifest(pod / load_pod_config(pod).manifest).entries[0]
    saved = torch.load(pod / entry["checkpoint"], weights_only=True)
    brain = pod / "checkpoints" / "BRAIN_MERGED.pt"
    torch.save(saved["model_state"], brain)          # a bare state_dict: no head, no config
    done = fractus_pod(pod, "probe", "--checkpoint", str(brain), "--shard", entry["shard"])
    assert done.returncode == 0, done.stdout + done.stderr
    assert (f"the checkpoint records no train head: probed from GPU 0's manifest head, "
            f"token {entry['start_token']:,} (choose another with --head)") in done.stdout
    report = probe_json(pod, "--checkpoint", str(brain), "--shard", entry["shard"])
    assert report["start"] == entry["start_token"] and report["next_token"] is None
    chosen = probe_json(pod, "--checkpoint", str(brain), "--shard", entry["shard"],
                        "--head", "640")
    assert chosen["start"] == 640 and "head_note" not in chosen
    # A full checkpoint keeps the head it records; --gpu takes --head too.
    recorded = probe_json(pod, "--checkpoint", entry["checkpoint"], "--shard", entry["shard"])
    assert recorded["start"] == entry["start_token"] and "head_note" not in recorded
    assert probe_json(pod, "--gpu", "0", "--head", "640")["start"] == 640
    other = pod / "data" / "other_shard.npy"
    other.write_bytes((pod / entry["shard"]).read_bytes())
    report = probe_json(pod, "--checkpoint", str(brain), "--shard", str(other))
    assert report["start"] == 0 and "the start of the shard" in report["head_note"]
