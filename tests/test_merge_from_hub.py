"""The mean-merged brain of checkpoints that are only on the hub (a Ray pod's are on its
nodes, which push them): read back one at a time from the revision that holds each, bitwise
the merge of the same files on disk; through `fractus-pod merge` too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from launcher.cli import main as cli_main
from launcher.files import sha256_file
from launcher.hub import IntegrityError, open_store
from launcher.paths import HUB_SCRATCH_DIR
from launcher.hub.merge import merge_checkpoints


def write_checkpoints(where: Path, n: int) -> list[Path]:
    paths = []
    for gpu in range(n):
        gen = torch.Generator().manual_seed(gpu)
        state = {"w": torch.randn(64, 32, generator=gen), "b": torch.randn(32, generator=gen),
                 "step_counter": torch.tensor(10 + gpu), "thought_state": torch.zeros(gpu + 1, 4)}
        path = where / "checkpoints" / f"fractus_1b_gpu{gpu}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"model_state": state, "config": {"d_model": 32}}, path)
        paths.append(path)
    return paths


def push_from_node(hub: Path, node: Path, paths: list[Path]) -> dict[str, tuple[str, str]]:
    """What each node does: push its GPU's checkpoint (a revision each). hub path ->
    (revision, sha256)."""
    store = open_store(f"file://{hub}", node)
    pushed = {}
    for path in paths:
        rel = str(path.relative_to(node))
        sha = sha256_file(path)
        pushed[rel] = (store.push({rel: path}, f"node push {rel}", expected={rel: sha}), sha)
    return pushed


def assert_same_merge(a: Path, b: Path) -> None:
    got, want = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    assert got["config"] == want["config"] and list(got["model_state"]) == list(want["model_state"])
    for key, t in want["model_state"].items():
        assert torch.equal(got["model_state"][key], t), key


def test_a_merge_reads_hub_only_checkpoints_one_at_a_time_bitwise_the_merge_on_disk(tmp_path):
    node, head = tmp_path / "node", tmp_path / "head"
    head.mkdir()
    paths = write_checkpoints(node, 3)
    pushed = push_from_node(tmp_path / "hub", node, paths)
    merge_checkpoints(paths, tmp_path / "on_disk.pt")

    store = open_store(f"file://{tmp_path / 'hub'}", head)
    scratch = head / HUB_SCRATCH_DIR
    held = []

    def from_hub(rel: str):
        held.append(len(list(scratch.rglob("*.pt"))) if scratch.exists() else 0)
        revision, sha = pushed[rel]
        return store.fetched(rel, revision, sha)

    merge_checkpoints(list(pushed), head / "merged.pt", fetch=from_hub)
    assert_same_merge(head / "merged.pt", tmp_path / "on_disk.pt")
    assert held == [0, 0, 0]                 # each pulled file gone before the next comes
    assert not scratch.exists()              # and the scratch folder with them
    assert sorted(p.name for p in head.iterdir()) == ["merged.pt"]

    # The revision holds other bytes than the manifest recorded: refused, nothing written.
    rel = next(iter(pushed))
    with pytest.raises(IntegrityError, match="not the recorded"):
        merge_checkpoints([rel], head / "other.pt",
                          fetch=lambda r: store.fetched(r, pushed[r][0], "0" * 64))
    assert not (head / "other.pt").exists() and not scratch.exists()


def test_fractus_pod_merge_on_a_head_without_the_checkpoints_reads_them_from_the_hub(
        tmp_path, capsys):
    pod = tmp_path / "pod"
    assert cli_main(["--pod-dir", str(pod), "init", "--preset", "tiny-cpu", "--no-data"]) == 0
    config_file = pod / "fractus-pod.yaml"
    config_file.write_text(config_file.read_text() + "hub: file://hub\n")
    node = tmp_path / "node"
    paths = write_checkpoints(node, 2)
    pushed = push_from_node(pod / "hub", node, paths)
    manifest = {f"gpu_{gpu}": {"start_token": 4096, "checkpoint": rel, "checkpoint_sha256": sha,
                               "hub_revision": revision}
                for gpu, (rel, (revision, sha)) in enumerate(pushed.items())}
    manifest_file = pod / "checkpoints" / "RESUME_MANIFEST_8GPU.json"
    manifest_file.parent.mkdir(parents=True, exist_ok=True)
    manifest_file.write_text(json.dumps(manifest))
    capsys.readouterr()

    assert cli_main(["--pod-dir", str(pod), "merge", "--out", "merged.pt"]) == 0
    assert "2 read from the hub" in capsys.readouterr().out
    merge_checkpoints(paths, tmp_path / "on_disk.pt")
    assert_same_merge(pod / "merged.pt", tmp_path / "on_disk.pt")
    assert not (pod / "checkpoints" / "fractus_1b_gpu0.pt").exists()   # nothing left behind

    # A GPU whose checkpoint is neither here nor recorded on the hub: one line, exit 2.
    del manifest["gpu_1"]["hub_revision"]
    manifest_file.write_text(json.dumps(manifest))
    assert cli_main(["--pod-dir", str(pod), "merge", "--out", "again.pt"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "gpu_1" in err and "gpu_0" not in err
    assert not (pod / "again.pt").exists()


def test_a_ray_pods_last_push_carries_the_merged_brain_read_back_from_the_nodes_pushes(tmp_path):
    """`sync.merge` on a remote backend (launcher/hub/sync.py `nodes_push`): the manifest
    pushes that follow each node's push carry no brain (it would read every GPU's checkpoint
    back from the hub each time); the last push of the run carries it, the mean of exactly
    the checkpoints that manifest names."""
    import yaml

    from launcher.config.podconfig import load_pod_config
    from launcher.hub.sync import HubSync, RunLease
    from launcher.paths import MERGED_PATH
    from launcher.pod.ckpt_index import CheckpointIndex
    from launcher.pod.events import EventLog, read_events
    from launcher.pod.manifest import read_manifest

    pod = tmp_path / "pod"
    assert cli_main(["--pod-dir", str(pod), "init", "--preset", "tiny-cpu", "--no-data"]) == 0
    config_file = pod / "fractus-pod.yaml"
    doc = yaml.safe_load(config_file.read_text())
    doc["sync"] = {"interval": 3600, "merge": True}
    config_file.write_text(yaml.safe_dump(doc))
    config = load_pod_config(pod)
    manifest = read_manifest(pod / config.manifest)
    node = tmp_path / "node"
    paths = write_checkpoints(node, 2)
    pushed = push_from_node(pod / "hub", node, paths)
    on_hub = {gpu: {"gpu": gpu, "sha256": sha, "hub_revision": revision, "next_token": 4096,
                    "step": 64, "ema_tf": 5.0, "lb": 2.0, "path": rel}
              for gpu, (rel, (revision, sha)) in enumerate(pushed.items())}
    log = EventLog(pod)
    sync = HubSync(pod, config, manifest, CheckpointIndex(pod), log, RunLease(pod, log))
    sync.nodes_push(lambda: on_hub)

    sync.tick()                                  # a node pushed: the manifest follows
    sync.finish()                                # waits for it, then the end of the run
    store = open_store(config.hub, pod)
    followed, last = [e for e in read_events(pod) if e["event"] == "sync_pushed"]
    assert followed["reason"] == "manifest" and last["reason"] == "stop"
    assert MERGED_PATH not in store.files(followed["revision"])
    assert MERGED_PATH in store.files(last["revision"])
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    open_store(f"file://{pod / 'hub'}", fresh).pull([MERGED_PATH], revision=last["revision"])
    merge_checkpoints(paths, tmp_path / "on_disk.pt")
    assert_same_merge(fresh / MERGED_PATH, tmp_path / "on_disk.pt")
    assert not (pod / HUB_SCRATCH_DIR).exists()
