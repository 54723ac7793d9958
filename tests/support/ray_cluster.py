"""A real multi-node Ray cluster on this machine, bound to loopback (tests and benchmarks).

`ray.cluster_utils.Cluster`: a head with no worker devices, and nodes of `num_cpus=1` with
a custom resource "fractus_gpu" standing in for GPUs. Ray's default address on Linux is
the machine's interface; RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (read when Ray is imported,
and inherited by the launcher the test starts) makes loopback the default, and every node
is given 127.0.0.1 explicitly.
"""

from __future__ import annotations

import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

import psutil

LOOPBACK = "127.0.0.1"
RESOURCE = "fractus_gpu"
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
RAY_PROCESS_WORDS = ("raylet", "gcs_server", "ray::", "default_worker.py", "dashboard_agent",
                     "runtime_env_agent", "log_monitor.py", "monitor.py --logs-dir")


def ray_process_table() -> dict[int, str]:
    """pid -> command line of every Ray process on this machine."""
    found = {}
    for proc in psutil.process_iter(["pid", "cmdline"]):   # info: no error on a zombie
        text = " ".join(proc.info["cmdline"] or [])
        if any(word in text for word in RAY_PROCESS_WORDS) and "pytest" not in text:
            found[proc.info["pid"]] = text
    return found


def ray_processes() -> list[str]:
    return [f"{pid}: {text[:120]}" for pid, text in ray_process_table().items()]


def add_node(cluster, devices: int):
    return cluster.add_node(num_cpus=1, resources={RESOURCE: devices}, node_ip_address=LOOPBACK)


@contextmanager
def local_cluster(nodes: int, devices_per_node: int):
    """Yields the started Cluster; stops it after and waits until no Ray process is left
    (AssertionError otherwise). Its session directory (/tmp/ray/session_*: the logs of
    every Ray process) is removed after a body that raised nothing;
    after one that raised it stays, to be read."""
    os.environ[LOOPBACK_ENV] = "0"
    from ray.cluster_utils import Cluster
    assert not ray_processes(), f"Ray processes from elsewhere are running: {ray_processes()}"
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "node_ip_address": LOOPBACK, "include_dashboard": False})
    session, raised = Path(cluster.head_node.get_session_dir_path()), True
    try:
        for _ in range(nodes):
            add_node(cluster, devices_per_node)
        yield cluster
        raised = False
    finally:
        cluster.shutdown()
        os.environ.pop(LOOPBACK_ENV, None)
        deadline = time.monotonic() + 60
        while ray_processes() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not ray_processes(), f"Ray left processes behind: {ray_processes()}"
        if not raised:
            shutil.rmtree(session, ignore_errors=True)


def node_of(cluster, short_id: str):
    """The cluster's node whose id starts with `short_id` (the launcher's events)."""
    (node,) = [n for n in cluster.worker_nodes if n.node_id.startswith(short_id)]
    return node


def lose_node(cluster, short_id: str, worker_pid: int) -> None:
    """A machine gone at once: the GPU's actor (the parent of `worker_pid`) and everything it
    started (the worker, its recovery pusher, a probe) frozen (SIGSTOP: no final save, no
    push, and the launcher cannot take the dead actor for one on a live node), the node's
    Ray processes stopped without grace, then the frozen ones SIGKILLed."""
    import signal
    actor = psutil.Process(psutil.Process(worker_pid).ppid())
    doomed = [actor, *actor.children(recursive=True)]
    for sig in (signal.SIGSTOP, None, signal.SIGKILL):
        if sig is None:
            cluster.remove_node(node_of(cluster, short_id), allow_graceful=False)
            continue
        for proc in doomed:
            try:
                proc.send_signal(sig)
            except psutil.NoSuchProcess:
                pass
    psutil.wait_procs(doomed, timeout=30)
