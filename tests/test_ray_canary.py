"""The stage canary of a Ray pod with `data:` (issue 18): the launcher runs it on its own
machine (the head) before any actor exists, while each node fetches only its own GPUs'
shards and pulls their checkpoints. The head must get exactly what the canary reads: the
canary GPU's current shard, fetched from the data store and verified, and its checkpoint,
pulled from the hub. Before, the head held neither and the canary could only fail.

A Ray test (a real cluster on this machine: tests/support/ray_cluster.py): one node of two
"fractus_gpu"."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import yaml

from launcher.hub import RetryPolicy
from launcher.hub.data_source import push_shards
from tests.support.canary_pod import CRITERIA, fractus_pod
from tests.support.e2e import (TOKENS_PER_STEP, Launcher, events_of, launchers, make_pod,
                               manifest_json, worker_records)
from tests.support.hub_pod import FAST_PASS
from tests.support.ray_cluster import RESOURCE, local_cluster

__all__ = ["launchers"]

STARTUP_S = 600          # a loaded 2-core machine: Ray and torch imports are slow
SHARDS = [f"data/shard_phase2_gpu{gpu}.npy" for gpu in (0, 1)]
CHECKPOINT = "checkpoints/fractus_1b_gpu0.pt"
STEPS = 6
# Checkpoints pass at once (so the stage-1 one reaches the hub); the canary of 3 steps.
PASSING = {**FAST_PASS, "canary": CRITERIA["canary"], "probe": CRITERIA["probe"]}


@pytest.fixture(scope="module")
def cluster():
    with local_cluster(nodes=1, devices_per_node=2) as cluster:
        yield cluster


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_ray_pods_canary_runs_on_the_head_from_the_shard_and_checkpoint_it_fetched(
        tmp_path, cluster, launchers):
    # Stage 1 trained STEPS steps, its checkpoint on the hub (the pod's file:// hub).
    pod = make_pod(tmp_path, criteria=PASSING)
    for args in (("launch", "--stage", "1", "--gpus", "0", "--max-steps", str(STEPS)),
                 ("sync", "push")):
        done = fractus_pod(pod, *args, timeout=STARTUP_S)
        assert done.returncode == 0, done.stdout + done.stderr
    entry = manifest_json(pod)["gpu_0"]
    assert entry["stage"] == 1 and entry["hub_revision"] and entry["checkpoint"] == CHECKPOINT
    checkpoint_sha = sha256(pod / CHECKPOINT)
    # Now as on a cluster: the shards only in the data store, the checkpoint only on the hub.
    shard_sha = {rel: sha256(pod / rel) for rel in SHARDS}
    source, _ = push_shards(pod, SHARDS, f"file://{tmp_path / 'data_store'}",
                            RetryPolicy(attempts=1))
    for rel in SHARDS:
        (pod / rel).unlink()
    (pod / CHECKPOINT).unlink()
    config = yaml.safe_load((pod / "fractus-pod.yaml").read_text())
    config.update(data=source.to_dict(),
                  ray={"address": cluster.address, "resource": RESOURCE, "fence_s": 5.0})
    (pod / "fractus-pod.yaml").write_text(yaml.safe_dump(config))

    launcher = Launcher(pod, "--stage", "2", "--gpus", "0", "--max-steps", "2")
    launchers.append(launcher)
    assert launcher.wait(STARTUP_S) == 0, launcher.output()[-3000:]

    (canary,) = events_of(pod, "canary")
    assert canary["passed"] and (canary["from_stage"], canary["to_stage"]) == (1, 2), canary
    assert canary["start_token"] == STEPS * TOKENS_PER_STEP      # the stage-1 checkpoint
    # The head holds exactly what the canary read: GPU 0's shard and checkpoint, verified.
    assert [p.name for p in (pod / "data").iterdir()] == ["shard_phase2_gpu0.npy"]
    assert sha256(pod / SHARDS[0]) == shard_sha[SHARDS[0]]
    assert sha256(pod / CHECKPOINT) == checkpoint_sha
    # The worker still ran on its node, from the shard that node fetched for itself.
    (placed,) = events_of(pod, "worker_placed", gpu=0)
    (fetched,) = events_of(pod, "shards_fetched", gpu=0)
    assert fetched["shards"] == [SHARDS[0]] and fetched["ts"] > canary["ts"]
    assert sha256(Path(placed["workdir"]) / SHARDS[0]) == shard_sha[SHARDS[0]]
    start = [r for r in worker_records(pod, 0, "start") if r["ts"] > canary["ts"]]
    assert start and start[0]["next_token"] == STEPS * TOKENS_PER_STEP
    assert manifest_json(pod)["gpu_0"]["stage"] == 2
