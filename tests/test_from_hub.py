"""`fractus-pod launch --from-hub URL [--revision R]`: a pod rebuilt in an empty directory
from the test hub (real HfApi, real launcher and workers) resumes where the hub says."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fractus.data import synth
from launcher.pod.ckpt_index import CheckpointIndex
from launcher.cli import main as cli_main
from tests.support.e2e import (REPO, SHARD_TOKENS, TOKENS_PER_STEP,  # noqa: F401
                               Launcher, events_of, launchers, make_pod, manifest_json,
                               worker_records)
from tests.support.from_hub import launch_from_hub
from tests.support.hf_client import REPO_ID, assert_no_token, quiet_hf_client  # noqa: F401
from tests.support.hub_pod import CKPT, FAST_PASS
from tests.support.hub_server import test_hub  # noqa: F401  (pytest fixture)

pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")
URL = f"hf://{REPO_ID}"


def test_rebuilt_pod_resumes_at_the_pinned_revisions_tokens_with_equal_weights(
        test_hub, tmp_path, launchers):
    shared = tmp_path / "shared_data"          # shards live outside the pod, as on a cluster
    synth(shared, shards=2, tokens=SHARD_TOKENS, vocab=512, seed=0)
    pod = make_pod(tmp_path, criteria=FAST_PASS, hub=URL, sync={"interval": 3600},
                   shards=str(shared / "shard_phase2_gpu{i}.npy"), demo_data=None)
    first = Launcher(pod, "--stage", "2", "--max-steps", "6")
    launchers.append(first)
    assert first.wait(120) == 0, first.output()
    (pinned,) = events_of(pod, "sync_pushed")
    pinned_manifest = manifest_json(pod)
    pinned_tensors = {g: torch.load(pod / CKPT.format(g), weights_only=True) for g in (0, 1)}
    second = Launcher(pod, "--max-steps", "4")            # the hub moves on: tokens 10 steps
    launchers.append(second)
    assert second.wait(120) == 0, second.output()
    newest = events_of(pod, "sync_pushed")[-1]
    assert newest["revision"] != pinned["revision"]
    assert newest["tokens"]["0"] == 10 * TOKENS_PER_STEP

    # A pod directory that is not empty is refused: nothing is overwritten.
    assert cli_main(["--pod-dir", str(pod), "launch", "--from-hub", URL]) == 2

    rebuilt = tmp_path / "rebuilt"
    done = launch_from_hub(rebuilt, URL, "--revision", pinned["revision"], "--max-steps", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    (event,) = events_of(rebuilt, "rebuilt_from_hub")
    assert event["revision"] == pinned["revision"]
    index = CheckpointIndex(rebuilt)
    for gpu in (0, 1):
        expected = pinned_manifest[f"gpu_{gpu}"]
        assert expected["start_token"] == 6 * TOKENS_PER_STEP
        # The workers resumed at the pinned manifest's tokens ...
        assert worker_records(rebuilt, gpu, "start")[0]["next_token"] == expected["start_token"]
        # ... from the very weights the first pod had there (the pulled file, kept by the
        # launcher as this pod's baseline before the worker saved over it).
        (baseline,) = [r for r in index.for_gpu(gpu) if r["sha256"] == expected["checkpoint_sha256"]]
        pulled = torch.load(rebuilt / baseline["retained"], weights_only=True)
        original = pinned_tensors[gpu]
        flat_pulled, flat_original = _tensors(pulled), _tensors(original)
        assert flat_pulled.keys() == flat_original.keys() and flat_original
        for key, tensor in flat_original.items():
            assert flat_pulled[key].dtype == tensor.dtype
            assert torch.equal(flat_pulled[key], tensor), key
    config = (rebuilt / "fractus-pod.yaml").read_text()
    assert URL in config and str(shared) in config
    assert_no_token(rebuilt, pod, texts=(done.stdout, done.stderr))


def test_a_pod_whose_shards_are_only_on_a_dataset_repo_is_rebuilt_with_verified_shards(
        test_hub, tmp_path, launchers):
    """`data push` puts the shards on a dataset repo and names its revision in the config;
    `launch --from-hub` into an empty directory then fetches them (hashed as they arrive)
    and every GPU resumes at the pushed manifest's token on the very bytes it trained on."""
    dataset = "hf://datasets/fractus/pod-shards"
    pod = make_pod(tmp_path, criteria=FAST_PASS, hub=URL, sync={"interval": 3600})
    assert cli_main(["--pod-dir", str(pod), "data", "push", "--to", dataset]) == 0
    first = Launcher(pod, "--stage", "2", "--max-steps", "6")
    launchers.append(first)
    assert first.wait(120) == 0, first.output()
    (pushed,) = events_of(pod, "sync_pushed")
    pushed_manifest = manifest_json(pod)

    rebuilt = tmp_path / "rebuilt"
    done = launch_from_hub(rebuilt, URL, "--max-steps", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    (event,) = events_of(rebuilt, "rebuilt_from_hub")
    assert event["revision"] == pushed["revision"]
    stamps = (rebuilt / "logs" / "data_verified.json").read_text()
    for gpu in (0, 1):
        shard = f"data/shard_phase2_gpu{gpu}.npy"
        assert (rebuilt / shard).read_bytes() == (pod / shard).read_bytes()
        assert shard in stamps
        expected = pushed_manifest[f"gpu_{gpu}"]["start_token"]
        assert expected == 6 * TOKENS_PER_STEP
        assert worker_records(rebuilt, gpu, "start")[0]["next_token"] == expected
    # The shards came from the dataset repo only: the pod's hub never held them.
    assert not any("shard_phase2" in r.path for r in test_hub.routed("resolve")
                   if "pod-shards" not in r.path)
    assert_no_token(rebuilt, pod, texts=(done.stdout, done.stderr))


def test_from_hub_refuses_a_revision_the_hub_does_not_have(test_hub, tmp_path):
    pod = tmp_path / "empty"
    done = launch_from_hub(pod, URL, "--revision", "0" * 40)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "revision" in done.stderr
    assert not pod.exists()         # nothing left behind: the same command can be rerun


def _tensors(obj, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, by its path in the nested dicts/lists."""
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    out: dict[str, torch.Tensor] = {}
    if isinstance(obj, dict):
        for key, value in obj.items():
            out.update(_tensors(value, f"{prefix}/{key}"))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            out.update(_tensors(value, f"{prefix}/{i}"))
    return out
