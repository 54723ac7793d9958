"""Recovery copies of a Ray node's GPUs go up batched (launcher/supervise/ray/recovery.py):
one commit per node for every GPU's newest checked save, at a cadence derived from the
hub's commit budget, and a worker's final save at once; driven step by step, without a
cluster, with the real huggingface_hub client against the local test hub.

Each save used to be a commit of its own, per GPU: 1.00 commit per save, 7-27x over the
128 commits an hour a Hub repository takes at the throughput the 1B run aims for."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from launcher.files import read_json_state, write_json_state
from launcher.hub import open_store
from launcher.hub.lease import pod_id
from launcher.paths import (RECOVERY_COMMIT_STATE, RECOVERY_SENDING_PREFIX,
                            RECOVERY_STAGING_DIR)
from launcher.hub.commit_budget import HUB_COMMITS_PER_HOUR, recovery_commits_per_hour
from launcher.supervise.ray.recovery import RecoveryPusher, read_recovery_copy
from launcher.supervise.ray.recovery_staging import commit_every_s, gpu_commit_every_s
from tests.support.hub_server import test_hub  # noqa: F401  (pytest fixture)
from tests.support.saves import write_save

pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")

REPO = "fractus/run-recovery"
HUB = f"hf://{REPO}"

# So many GPUs that the node's cadence (an hour here) never elapses by itself in the test:
# the test moves the last commit back instead.
POD_GPUS = 64


def ckpt(gpu: int) -> str:
    return f"checkpoints/fractus_1b_gpu{gpu}.pt"


def save(workdir: Path, metrics: Path, gpu: int, token: int) -> None:
    """A save of `gpu` at `token` and its event line in the worker's metrics."""
    with open(metrics, "a") as f:
        f.write(json.dumps(write_save(workdir, gpu, token)) + "\n")


@pytest.fixture
def node(tmp_path, test_hub):
    """A node's workdir with two GPUs' 'workers' (sleeping processes) and their pushers."""
    workdir, hub = tmp_path / "node", HUB
    (workdir / "logs").mkdir(parents=True)
    workers, pushers = [], []
    for gpu in (0, 1):
        metrics = workdir / "logs" / f"metrics_gpu{gpu}.jsonl"
        metrics.write_text("")
        worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        workers.append(worker)
        pushers.append(RecoveryPusher({
            "gpu": gpu, "workdir": str(workdir), "metrics": f"logs/{metrics.name}",
            "offset": 0, "pid": worker.pid,
            "create_time": psutil.Process(worker.pid).create_time(), "hub_url": hub,
            "writer": pod_id(tmp_path / "pod"), "attempt": f"attempt-{gpu}",
            "run_id": "run-a", "node": "node-a",
            "gpu_commit_every_s": gpu_commit_every_s(HUB, POD_GPUS)}))
        pushers[-1]._register()
    yield workdir, hub, workers, pushers
    for worker in workers:
        worker.kill()
        worker.wait()


def test_a_nodes_saves_go_up_in_one_commit_per_cadence_not_one_per_save(tmp_path, node,
                                                                         test_hub):
    workdir, hub, workers, pushers = node
    store = open_store(hub, tmp_path / "reader")

    def recovery_commits() -> int:
        return sum("recovery cop" in c.title for c in test_hub.commits(REPO))
    saves = 0
    for token in (160, 320, 480, 640):
        for gpu, pusher in enumerate(pushers):
            save(workdir, workdir / pusher.spec["metrics"], gpu, token)
            saves += 1
            pusher._read()
            pusher._push_waiting()
    # The first saves of both GPUs in one commit (the second GPU's completed the batch);
    # the others wait for the node's cadence: 1 commit for 8 saves (it was 8).
    assert recovery_commits() == 1
    first = store.files(store.head())
    assert {f"recovery/{ckpt(0)}", f"recovery/{ckpt(1)}"} <= set(first)

    # The cadence elapses: one commit carries each GPU's newest save, none of the others.
    state = workdir / RECOVERY_STAGING_DIR / RECOVERY_COMMIT_STATE
    write_json_state(state, {**read_json_state(state), "at": time.time() - 2 * 3600})
    pushers[0]._push_waiting()
    assert recovery_commits() == 2
    for gpu in (0, 1):
        copy = read_recovery_copy(hub, tmp_path / "pod", ckpt(gpu), gpu, f"attempt-{gpu}")
        assert copy["next_token"] == 640

    # A worker's final save (SIGTERM) goes up at once, whatever the cadence; then its
    # pusher exits.
    save(workdir, workdir / pushers[0].spec["metrics"], 0, 800)
    saves += 1
    workers[0].kill()
    workers[0].wait()
    pushers[0].run()
    assert recovery_commits() == 3
    assert read_recovery_copy(hub, tmp_path / "pod", ckpt(0), 0, "attempt-0")["next_token"] \
        == 800
    assert recovery_commits() / saves == 3 / 9


def test_the_cadence_keeps_a_pods_recovery_commits_within_its_share_of_the_hubs_budget():
    """Summed over the pod's nodes (node_gpus of pod_gpus each), the commits an hour stay
    the recovery copies' share of the repo's budget (launcher/hub/commit_budget.py)."""
    share = recovery_commits_per_hour(HUB_COMMITS_PER_HOUR)
    assert share == 32
    for layout in ([8], [4, 4], [1] * 8, [2, 3, 3]):
        every = gpu_commit_every_s(HUB, sum(layout))
        per_hour = sum(3600 / commit_every_s(every, gpus) for gpus in layout)
        assert per_hour == pytest.approx(share)
    assert commit_every_s(gpu_commit_every_s(HUB, 8), 8) == 112.5   # 1b preset, one node
    assert gpu_commit_every_s(HUB, 8, budget=64) == 2 * gpu_commit_every_s(HUB, 8)
    assert gpu_commit_every_s("file:///srv/hub", 8) == 0     # a directory: no budget


def test_links_left_by_a_committer_killed_mid_commit_go_with_the_next_commit(tmp_path):
    """A pusher killed while committing leaves its links (8.8 GB each at the 1B model) in
    the node's staging directory; the node's next commit, under its lock, removes them."""
    workdir = tmp_path / "node"
    stale = workdir / RECOVERY_STAGING_DIR / f"{RECOVERY_SENDING_PREFIX}999999-dead"
    stale.mkdir(parents=True)
    (stale / "posted-gpu0-attempt-0-0123.pt").write_bytes(b"weights")
    metrics = workdir / "logs" / "metrics_gpu0.jsonl"
    metrics.parent.mkdir(parents=True)
    metrics.write_text("")
    pusher = RecoveryPusher({"gpu": 0, "workdir": str(workdir),
                             "metrics": "logs/metrics_gpu0.jsonl", "offset": 0,
                             "hub_url": f"file://{tmp_path / 'hub'}",
                             "writer": pod_id(tmp_path / "pod"), "attempt": "attempt-0",
                             "run_id": "run-a", "node": "node-a"})
    save(workdir, metrics, 0, 160)
    pusher._read()
    pusher._push_waiting()
    assert read_recovery_copy(f"file://{tmp_path / 'hub'}", tmp_path / "pod", ckpt(0), 0,
                              "attempt-0")["next_token"] == 160
    assert not stale.exists()
    assert not list((workdir / RECOVERY_STAGING_DIR).glob(f"{RECOVERY_SENDING_PREFIX}*"))
