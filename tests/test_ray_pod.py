"""A pod across the nodes of a real Ray cluster on this machine (ray.cluster_utils.Cluster:
a head with no worker devices and two nodes of two "fractus_gpu" each, all bound to
127.0.0.1), supervised by the real launcher (`launch` with `ray:` in fractus-pod.yaml).

One pod, one cluster for the module: both workers placed one per node; a node removed
mid-run: its GPU resumes on the other node from its newest passed checkpoint on the hub,
at exactly its tokens and with exactly its weights; the last node removed: both GPUs wait,
visibly; a node joins: they resume on it. Teardown stops the cluster and checks that no
Ray process and no worker is left.
"""

from __future__ import annotations

import hashlib
import io
import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from tests.support.ray_cluster import (RESOURCE, add_node, local_cluster, node_of,
                                       ray_process_table)
from tests.test_launcher_e2e import (REPO, TOKENS_PER_STEP, Launcher, events_of, launchers,
                                     make_pod, wait_for, worker_records)

__all__ = ["launchers"]

STARTUP_S = 600          # a loaded 2-core machine: Ray and torch imports are slow


@pytest.fixture(scope="module")
def cluster():
    with local_cluster(nodes=2, devices_per_node=2) as cluster:
        yield cluster


def after(events: list[dict], ts: float) -> list[dict]:
    return [e for e in events if e["ts"] > ts]


def load(source) -> dict:
    return torch.load(source, map_location="cpu", weights_only=True)


def is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def listeners_off_loopback(pids: set[int]) -> list:
    return [f"{c.pid} {c.laddr.ip}:{c.laddr.port}" for c in psutil.net_connections("inet")
            if c.status == psutil.CONN_LISTEN and c.pid in pids and not is_loopback(c.laddr.ip)]


def test_a_pod_across_two_nodes_survives_losing_them(tmp_path, cluster, launchers):
    pod = make_pod(tmp_path, ray={"address": cluster.address,
                                  "workdir": str(tmp_path / "disk-{node}"),
                                  "resource": RESOURCE},
                   save_keep=1000)     # the resumed node's pulled file is never rotated away
    launcher = Launcher(pod, "--stage", "1")
    launchers.append(launcher)        # its teardown kills every worker it placed
    run_scenario(pod, cluster, launcher)


def status_rows(pod: Path) -> list[dict]:
    status = subprocess.run([sys.executable, "-m", "launcher.cli", "--pod-dir", str(pod),
                             "status", "--json"], cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    return json.loads(status.stdout)["gpus"]


def run_scenario(pod: Path, cluster, launcher: Launcher) -> None:
    # Launch across two nodes: one worker on each.
    placed = wait_for(lambda: len({e["gpu"] for e in events_of(pod, "worker_placed")}) == 2
                      and events_of(pod, "worker_placed"), STARTUP_S, "both workers placed")
    first_node = {e["gpu"]: e["node"] for e in placed}
    assert len(set(first_node.values())) == 2, first_node
    assert not listeners_off_loopback(set(ray_process_table()))

    # Metrics cross through Ray into the head's pod directory; a node pushes its passed
    # checkpoint to the hub itself.
    wait_for(lambda: worker_records(pod, 0, "checkpoint") and worker_records(pod, 1, "start"),
             STARTUP_S, "metrics of both workers on the head")
    wait_for(lambda: events_of(pod, "sync_pushed", gpu=0), STARTUP_S,
             "GPU 0's node pushing a passed checkpoint")
    assert not (pod / "checkpoints" / "fractus_1b_gpu0.pt").exists()   # never on the head

    # Node loss: GPU 0's node goes; GPU 0 resumes on the other node from the hub.
    cluster.remove_node(node_of(cluster, first_node[0]))
    (lost,) = wait_for(lambda: events_of(pod, "node_lost", gpu=0), 300, "the lost node")
    assert lost["node"] == first_node[0]
    pushed = [e for e in events_of(pod, "sync_pushed", gpu=0) if e["ts"] < lost["ts"]][-1]
    (point,) = events_of(pod, "resume_point", gpu=0)
    assert point["to_token"] == pushed["tokens"]["0"] and point["hub_revision"] == pushed["revision"]
    moved = wait_for(lambda: after(events_of(pod, "worker_placed", gpu=0), lost["ts"]), 300,
                     "GPU 0 placed again")[0]
    assert moved["node"] == first_node[1]
    start = wait_for(lambda: after(worker_records(pod, 0, "start"), lost["ts"]), STARTUP_S,
                     "the resumed worker's start")[0]
    assert start["next_token"] == point["to_token"]
    # Exactly the hub's checkpoint: its bytes on the new node, its weights, its tokens.
    from launcher.hub import open_store
    store = open_store("file://hub", pod)
    hub_file = store.files(point["hub_revision"])["checkpoints/fractus_1b_gpu0.pt"]
    node_dir = Path(moved["workdir"]) / "checkpoints"
    # Read once: the worker keeps rotating these names while the test looks.
    copies = [data for data in (p.read_bytes() for p in node_dir.glob("fractus_1b_gpu0.pt*"))
              if hashlib.sha256(data).hexdigest() == hub_file.sha256]
    assert copies, "the resumed node has no copy of the hub's checkpoint"
    scratch = pod.parent / "hub-copy"
    hub_copy = open_store("file://" + str(pod / "hub"), scratch).pull(
        ["checkpoints/fractus_1b_gpu0.pt"], revision=point["hub_revision"])
    theirs, ours = load(next(iter(hub_copy.values()))), load(io.BytesIO(copies[0]))
    assert ours["train_state"]["next_token"] == theirs["train_state"]["next_token"] \
        == point["to_token"]
    assert theirs["model_state"].keys() == ours["model_state"].keys()
    assert all(torch.equal(theirs["model_state"][k], ours["model_state"][k])
               for k in theirs["model_state"])
    first_line = wait_for(lambda: [r for r in after(worker_records(pod, 0), start["ts"])
                                   if r.get("type") == "metrics"], 300, "a step after resume")[0]
    assert first_line["next_token"] == point["to_token"] + TOKENS_PER_STEP   # none skipped

    # The last node goes: both GPUs wait, visibly; a node joins and is used.
    gone = time.time()
    cluster.remove_node(node_of(cluster, first_node[1]))
    wait_for(lambda: len(after(events_of(pod, "gpu_waiting"), gone)) == 2, 300,
             "both GPUs waiting for a node")
    wait_for(lambda: [r["state"] for r in status_rows(pod)] == ["waiting", "waiting"], 60,
             "`status` showing both GPUs waiting")
    add_node(cluster, 2)
    rejoined = wait_for(lambda: len(after(events_of(pod, "worker_placed"), gone)) == 2
                        and after(events_of(pod, "worker_placed"), gone), 300,
                        "both GPUs on the joined node")
    assert len({e["node"] for e in rejoined}) == 1
    assert not {e["node"] for e in rejoined} & set(first_node.values())
    wait_for(lambda: all(after(worker_records(pod, g, "start"), gone) for g in (0, 1)),
             STARTUP_S, "both workers training on the joined node")
    for gpu in (0, 1):
        resumed = after(events_of(pod, "resume_point", gpu=gpu), gone)[0]
        assert after(worker_records(pod, gpu, "start"), gone)[0]["next_token"] == \
            resumed["to_token"]

    os.killpg(launcher.proc.pid, signal.SIGTERM)
    assert launcher.wait(300) == 0, launcher.output()[-3000:]
