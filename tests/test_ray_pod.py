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

from launcher.ckpt_index import sha256_file
from tests.test_launcher_e2e import (REPO, TOKENS_PER_STEP, Launcher, events_of, launchers,
                                     make_pod, wait_for, worker_records)

__all__ = ["launchers"]

RAY_PROCESS_WORDS = ("raylet", "gcs_server", "ray::", "default_worker.py", "dashboard_agent",
                     "runtime_env_agent", "log_monitor.py", "monitor.py --logs-dir")
LOOPBACK = "127.0.0.1"
STARTUP_S = 600          # a loaded 2-core machine: Ray and torch imports are slow


def ray_processes() -> list[str]:
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        text = " ".join(proc.info["cmdline"] or [])
        if any(word in text for word in RAY_PROCESS_WORDS) and "pytest" not in text:
            found.append(f"{proc.info['pid']}: {text[:120]}")
    return found


@pytest.fixture(scope="module")
def cluster():
    # Ray's default on Linux is the machine's interface address; loopback keeps every
    # listener on this machine (read when ray is first imported).
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    from ray.cluster_utils import Cluster
    assert not ray_processes(), "Ray processes from elsewhere are running"
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "node_ip_address": LOOPBACK, "include_dashboard": False})
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=1, resources={"fractus_gpu": 2},
                             node_ip_address=LOOPBACK)
        yield cluster
    finally:
        cluster.shutdown()
        os.environ.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
        deadline = time.monotonic() + 60
        while ray_processes() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not ray_processes(), f"Ray left processes behind: {ray_processes()}"


def node_of(cluster, short_id: str):
    (node,) = [n for n in cluster.worker_nodes if n.node_id.startswith(short_id)]
    return node


def after(events: list[dict], ts: float) -> list[dict]:
    return [e for e in events if e["ts"] > ts]


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def kill_placed_workers(pod: Path) -> None:
    for e in events_of(pod, "worker_placed"):
        try:
            proc = psutil.Process(e["pid"])
            if "fractus.train.worker" in " ".join(proc.cmdline()):
                proc.kill()
                proc.wait(10)
        except psutil.Error:
            pass


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
                                  "resource": "fractus_gpu"})
    launcher = Launcher(pod, "--stage", "1")
    launchers.append(launcher)
    try:
        run_scenario(pod, cluster, launcher)
    finally:
        kill_placed_workers(pod)


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
    ray_pids = {p.pid for p in psutil.process_iter() if p.pid != os.getpid()
                and any(w in " ".join(p.cmdline()) for w in RAY_PROCESS_WORDS)}
    assert not listeners_off_loopback(ray_pids)

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
    copies = [p for p in node_dir.glob("fractus_1b_gpu0.pt*") if sha256_file(p) == hub_file.sha256]
    assert copies, "the resumed node has no copy of the hub's checkpoint"
    scratch = pod.parent / "hub-copy"
    hub_copy = open_store("file://" + str(pod / "hub"), scratch).pull(
        ["checkpoints/fractus_1b_gpu0.pt"], revision=point["hub_revision"])
    theirs, ours = load(next(iter(hub_copy.values()))), load(copies[0])
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
    cluster.add_node(num_cpus=1, resources={"fractus_gpu": 2}, node_ip_address=LOOPBACK)
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
