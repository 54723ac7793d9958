"""Faults of a GPU's node actor on a real one-node Ray cluster (one cluster for the module).

A call that raises on the node crashes its worker, never the launcher.

A node actor that stops answering (its process frozen: SIGSTOP here; a thread holding the
interpreter on a real node), supervised by the real launcher (`launch` in a child process).

Ray still holds the actor alive, so nothing reports it dead; its worker trains on, but no
line reaches the launcher, which kills the worker as hung. That kill waited on the actor's
poll in flight for ever: the launcher's loop, and with it every GPU of the pod, stopped (CI,
stop 23, after a poll that had fallen far behind). Now an actor that answers neither its
call nor the heartbeats is killed (`node_unresponsive`): its worker gets SIGTERM from its
dead parent and writes its final save, a new actor on the same node adopts the GPU, and the
GPU resumes from that save; the launcher serves the other GPU throughout.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import psutil
import pytest

from fractus.data import synth
from launcher.worker.process import read_records
from tests.support.e2e import (SHARD_TOKENS, TEST_CRITERIA, TOKENS_PER_STEP, Launcher,
                               events_of, launchers, make_pod, wait_for, worker_records)
from tests.support.ray_cluster import RESOURCE, local_cluster

__all__ = ["launchers"]

STARTUP_S = 600        # a loaded 2-core machine: Ray and torch imports are slow
FENCE_S = 5.0
HANG_S = 15.0          # the silence after which the launcher kills a worker as hung


@pytest.fixture(scope="module")
def cluster():
    with local_cluster(nodes=1, devices_per_node=2) as cluster:
        yield cluster


def node_lines(workdir: str, gpu: int) -> list[dict]:
    return read_records(Path(workdir) / "logs" / f"metrics_gpu{gpu}.jsonl")


def test_a_frozen_node_actor_is_killed_and_its_gpu_resumes_from_the_final_save(
        tmp_path, cluster, launchers):
    criteria = {**TEST_CRITERIA, "supervision": {
        **TEST_CRITERIA["supervision"], "hang": {"timeout_s": HANG_S, "startup_timeout_s": 120}}}
    pod = make_pod(tmp_path, criteria,
                   ray={"address": cluster.address, "resource": RESOURCE, "fence_s": FENCE_S},
                   stop_grace_s=10.0, save_keep=1000)
    # Ten times the usual shard: no GPU reaches its end (done) while the test looks.
    synth(pod / "data", shards=2, tokens=10 * SHARD_TOKENS, vocab=512, seed=0)
    launcher = Launcher(pod, "--stage", "1")
    launchers.append(launcher)
    placed = wait_for(lambda: len(events_of(pod, "worker_placed")) == 2
                      and events_of(pod, "worker_placed"), STARTUP_S, "both workers placed")
    wait_for(lambda: worker_records(pod, 0, "checkpoint"), STARTUP_S, "GPU 0's first save")

    worker_pid = next(e["pid"] for e in placed if e["gpu"] == 0)
    workdir = next(e["workdir"] for e in placed if e["gpu"] == 0)
    actor = psutil.Process(psutil.Process(worker_pid).ppid())
    frozen_at = time.time()
    actor.send_signal(signal.SIGSTOP)        # its worker (its own process) trains on
    try:
        hang = wait_for(lambda: events_of(pod, "hang", gpu=0), 120, "GPU 0 seen as hung")[0]
        assert hang["ts"] > frozen_at
        unresponsive = wait_for(lambda: events_of(pod, "node_unresponsive", gpu=0), 120,
                                "the frozen actor given up on")[0]
        assert unresponsive["node"] == placed[0]["node"]
    finally:
        try:
            actor.send_signal(signal.SIGCONT)   # a process Ray failed to end goes on ending
        except psutil.NoSuchProcess:
            pass
    # Its worker got SIGTERM from its dead parent and saved; the GPU resumes on the same
    # node (the only one) from exactly that save.
    (died,) = wait_for(lambda: events_of(pod, "actor_died", gpu=0), 120, "the adoption")
    assert died["pid"] == worker_pid
    wait_for(lambda: not psutil.pid_exists(worker_pid)
             or psutil.Process(worker_pid).status() == psutil.STATUS_ZOMBIE, 60,
             "the frozen actor's worker ended")
    final = [r for r in node_lines(workdir, 0) if r.get("event") == "checkpoint"][-1]
    start = wait_for(lambda: [r for r in worker_records(pod, 0, "start")
                              if r["ts"] > unresponsive["ts"]], STARTUP_S,
                     "GPU 0's worker started again")[0]
    assert start["next_token"] == final["next_token"]          # its final save, none lost
    first = wait_for(lambda: [r for r in worker_records(pod, 0)
                              if r.get("type") == "metrics" and r["ts"] > start["ts"]],
                     STARTUP_S, "a step after the restart")[0]
    assert first["next_token"] == final["next_token"] + TOKENS_PER_STEP
    # The launcher served GPU 1 all along: its lines reached the head while GPU 0's actor
    # was frozen, and after GPU 0's restart. (Whether GPU 1's own worker keeps under the
    # hang limit on a machine loaded past its cores is not this test's question.)
    assert [r for r in worker_records(pod, 1) if r.get("type") == "metrics"
            and frozen_at < r["ts"] < unresponsive["ts"]]
    wait_for(lambda: [r for r in worker_records(pod, 1)
                      if r.get("type") == "metrics" and r["ts"] > start["ts"]], 120,
             "GPU 1's lines after GPU 0's restart")
    assert launcher.proc.poll() is None


def test_a_call_that_fails_on_a_node_crashes_its_worker_not_the_launcher(tmp_path, cluster):
    """A node-side exception (the RayTaskError(FileNotFoundError) out of NodeWorker.poll
    that once took the whole launcher down) through the real supervisor and a real actor:
    the node's worker is killed, the error reaches the events and the GPU's log on the
    head, and the GPU restarts as after a crash."""
    import ray

    from launcher.supervise.custodian import CheckpointCustodian
    from launcher.pod.events import EventLog
    from launcher.supervise.plan import load_plan
    from launcher.supervise.ray.copies import open_ray
    from launcher.supervise.ray.node import NodeWorker
    from launcher.supervise.supervisor import Supervisor

    class FailsOnce(NodeWorker):
        """The real node actor, whose third poll raises as a vanished file did in CI."""
        polls = 0

        def poll(self):
            self.polls += 1
            if self.polls == 3:
                raise FileNotFoundError("checkpoints/retained/gone.pt vanished under the poll")
            return super().poll()

    pod = make_pod(tmp_path, ray={"address": cluster.address,
                                  "workdir": str(tmp_path / "disk-{node}"), "resource": RESOURCE})
    plan, manifest = load_plan(pod, 1, None, "0")
    events = EventLog(pod)
    supervisor = Supervisor(plan, manifest, CheckpointCustodian.for_plan(plan, manifest, events),
                            events)
    backend, custodian = open_ray(plan, events)
    try:
        backend.actor_class = ray.remote(FailsOnce)
        supervisor.use_backend(backend, custodian)
        supervisor.starter.start_all()

        def step_until(condition, what):
            def stepped():
                supervisor.step()
                return condition()
            return wait_for(stepped, STARTUP_S, what)

        (error,) = step_until(lambda: events_of(pod, "node_error", gpu=0), "the node's error")
        assert error["error"].startswith("RayTaskError(FileNotFoundError: ") \
            and "vanished under the poll" in error["error"]
        (placed,) = events_of(pod, "worker_placed", gpu=0)
        assert not psutil.pid_exists(placed["pid"]) or \
            psutil.Process(placed["pid"]).status() == psutil.STATUS_ZOMBIE   # killed
        (ended,) = events_of(pod, "worker_exit", gpu=0)
        assert ended["error"] == error["error"] and ended["code"] == -9
        (crash,) = events_of(pod, "worker_crash", gpu=0)
        assert crash["reason"] == error["error"]
        log = (pod / "logs" / "worker_gpu0.log").read_text()
        assert "FileNotFoundError" in log and "vanished under the poll" in log
        again = step_until(lambda: len(events_of(pod, "worker_placed", gpu=0)) == 2
                           and events_of(pod, "worker_placed", gpu=0), "the restart")
        assert again[1]["pid"] != placed["pid"] and supervisor.pod.runs[0].state == "running"
    finally:       # this process is a driver of the cluster: always disconnect it
        try:
            backend.stop([r.proc for r in supervisor.pod.runs.values() if r.proc is not None],
                         grace_s=20)
        finally:
            backend.close()
