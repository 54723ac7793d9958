"""What a Ray pod's head (the launcher's machine) does with `data:`, without a Ray cluster
(tests/test_ray_canary.py runs a whole launch on one). Each node fetches its own GPUs' shards
and pulls their checkpoints; the head
- gets exactly what its stage canary reads, since the canary runs there before any actor
  exists: the canary GPU's current data phase's shard (verified) and its checkpoint
  (pulled from the hub);
- looks every shard the nodes will fetch up in the store's index at launch, so a store they
  cannot use is refused in one line with nothing written, not at every worker start."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import yaml

from launcher.cli import main as cli_main
from launcher.errors import UserError
from launcher.hub import RetryPolicy
from launcher.hub.data_source import push_shards
from launcher.pod.manifest import read_manifest
from launcher.supervise.launch_shards import fetch_shards
from launcher.supervise.plan import load_plan
from launcher.supervise.plan import on_the_hub, shards_on_nodes
from launcher.supervise.stage_switch import ensure_canary_inputs

MANIFEST = "checkpoints/RESUME_MANIFEST_8GPU.json"
PHASES = ["data/shard_phase2_gpu{i}.npy", "data/shard_phase3_gpu{i}.npy"]


def ray_pod_in_store(tmp_path: Path, manifest: dict | None = None) -> Path:
    """A tiny-cpu pod with two data phases whose shards are only in a file:// store."""
    pod = tmp_path / "pod"
    assert cli_main(["--pod-dir", str(pod), "init", "--preset", "tiny-cpu"]) == 0
    shards = [p.format(i=gpu) for p in PHASES for gpu in (0, 1)]
    for gpu in (0, 1):
        os.link(pod / shards[gpu], pod / shards[2 + gpu])
    source, _ = push_shards(pod, shards, f"file://{tmp_path / 'store'}", RetryPolicy(attempts=1))
    for rel in shards:
        (pod / rel).unlink()
    config = yaml.safe_load((pod / "fractus-pod.yaml").read_text())
    config.update(shards=PHASES, data=source.to_dict())
    (pod / "fractus-pod.yaml").write_text(yaml.safe_dump(config))
    if manifest is not None:
        write_manifest(pod, manifest)
    return pod


def write_manifest(pod: Path, manifest: dict) -> None:
    (pod / MANIFEST).parent.mkdir(exist_ok=True)
    (pod / MANIFEST).write_text(json.dumps(manifest))


def on_head(pod: Path) -> list[str]:
    return sorted(str(p.relative_to(pod)) for p in (pod / "data").iterdir())


def stamped(pod: Path) -> dict:
    return json.loads((pod / "logs" / "data_verified.json").read_text())["files"]


@pytest.mark.parametrize("manifest, canary_reads", [
    (None, "data/shard_phase2_gpu0.npy"),                              # a new pod: phase 1
    ({"gpu_0": {"start_token": 0, "phase": 2}}, "data/shard_phase3_gpu0.npy"),
])
def test_a_ray_pods_head_fetches_only_the_shard_its_canary_reads(tmp_path, manifest,
                                                                 canary_reads):
    """With data: the nodes fetch their GPUs' shards; the head gets exactly the canary GPU's
    current phase's shard, verified (stamped), and nothing else; with no canary, none."""
    pod = ray_pod_in_store(tmp_path, manifest)
    plan, read = load_plan(pod, 2, None, None)
    on_nodes = shards_on_nodes(plan, on_ray=True)
    fetch_shards(plan, read, on_nodes, canary=False)
    assert on_head(pod) == []
    fetch_shards(plan, read, on_nodes, canary=True)
    assert on_head(pod) == [canary_reads]
    assert list(stamped(pod)) == [canary_reads]
    assert stamped(pod)[canary_reads]["sha256"] == \
        hashlib.sha256((pod / canary_reads).read_bytes()).hexdigest()


def test_the_canary_gets_its_gpus_shard_again_when_its_phase_moved_after_the_fetch(tmp_path):
    """A rollback decided by the last launcher is completed after fetch_shards: the canary's
    GPU may then be in another phase, whose shard the gate verifies right before the canary."""
    pod = ray_pod_in_store(tmp_path, {"gpu_0": {"start_token": 0, "phase": 2}})
    plan, read = load_plan(pod, 2, None, None)
    fetch_shards(plan, read, shards_on_nodes(plan, on_ray=True), canary=True)
    write_manifest(pod, {"gpu_0": {"start_token": 0}})            # back in phase 1
    ensure_canary_inputs(plan, read_manifest(pod / MANIFEST))
    assert on_head(pod) == ["data/shard_phase2_gpu0.npy", "data/shard_phase3_gpu0.npy"]
    ensure_canary_inputs(plan, read_manifest(pod / MANIFEST))      # stamped: nothing to do
    assert list(stamped(pod)) == ["data/shard_phase3_gpu0.npy", "data/shard_phase2_gpu0.npy"]


def test_the_canarys_checkpoint_is_pulled_to_the_head_the_others_stay_on_the_hub(tmp_path):
    """GPUs whose checkpoint only the hub holds are pulled by their nodes (on_the_hub); the
    canary's is pulled to the head right before the canary, under the name its entry gives
    (the entry unchanged: its node pulls it by that name), with the recorded bytes."""
    from tests.support.passed_checkpoints import new_checkpoints
    pod = ray_pod_in_store(tmp_path)
    new_checkpoints(pod, 64, 4096, gpus=(0, 1))
    assert cli_main(["--pod-dir", str(pod), "sync", "push"]) == 0
    named = read_manifest(pod / MANIFEST).entries[0]
    recorded = (named.checkpoint, named.checkpoint_sha256, named.hub_revision)
    assert all(recorded)
    for gpu in (0, 1):                       # as on a pod rebuilt from the hub onto a cluster
        (pod / f"checkpoints/fractus_1b_gpu{gpu}.pt").unlink()
    plan, read = load_plan(pod, 2, None, None)
    assert on_the_hub(plan, read) == {0, 1}
    ensure_canary_inputs(plan, read)
    assert hashlib.sha256((pod / named.checkpoint).read_bytes()).hexdigest() == recorded[1]
    assert not (pod / "checkpoints/fractus_1b_gpu1.pt").exists()
    entry = read.entries[0]
    assert (entry.checkpoint, entry.checkpoint_sha256, entry.hub_revision) == recorded
    assert on_head(pod) == ["data/shard_phase2_gpu0.npy"]          # and its shard


def tree(pod: Path) -> list:
    return sorted((str(p), p.read_bytes() if p.is_file() else None) for p in pod.rglob("*"))


@pytest.mark.parametrize("change, words", [
    ({"revision": "f" * 64}, "data: cannot read revision ffffffffffff"),
    ({"url": "file:///nonexistent/store"}, "data: cannot read revision"),
    ({"shards": [*PHASES, "data/later_gpu{i}.npy"]},
     "records no data/later_gpu0.npy, data/later_gpu1.npy; put the shards there"),
], ids=["no-such-revision", "no-store", "phase-not-recorded"])
def test_a_store_the_nodes_could_not_use_refuses_the_ray_launch_with_nothing_written(
        tmp_path, change, words):
    """Before, the head never read the store on a Ray launch: each node's worker start
    failed instead, again at every restart, on every node."""
    pod = ray_pod_in_store(tmp_path)
    config = yaml.safe_load((pod / "fractus-pod.yaml").read_text())
    if "shards" in change:
        config["shards"] = change["shards"]
    else:
        config["data"] = {**config["data"], **change}
    (pod / "fractus-pod.yaml").write_text(yaml.safe_dump(config))
    plan, read = load_plan(pod, 1, None, None)
    before = tree(pod)
    with pytest.raises(UserError) as refused:
        fetch_shards(plan, read, shards_on_nodes(plan, on_ray=True))
    assert words in str(refused.value) and "\n" not in str(refused.value), refused.value
    assert tree(pod) == before
