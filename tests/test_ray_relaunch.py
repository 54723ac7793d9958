"""A relaunch after the launcher's kill -9 on a real Ray cluster (ray.cluster_utils.Cluster on
this machine, one node of one "fractus_gpu"): the node fences its worker, which writes its
final save and pushes it as a recovery copy; the next `launch` resumes the GPU from that
copy (its node pulls and checks it), not from the older checkpoint its manifest names.
The cluster is stopped at the end, with no Ray process left."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import psutil

from launcher.paths import RAY_LINEAGE_FILE
from launcher.supervise.ray.recovery import read_recovery_copy, recovery_path
from tests.support.e2e import (Launcher, events_of, launchers, make_pod, manifest_json,
                               wait_for, worker_records)
from tests.support.ray_cluster import RESOURCE, local_cluster

__all__ = ["launchers"]

STARTUP_S = 600          # a loaded 2-core machine: Ray and torch imports are slow
FENCE_S = 5.0
CKPT = "checkpoints/fractus_1b_gpu0.pt"


def node_checkpoints(workdir: str) -> list[dict]:
    from launcher.worker.process import read_records
    return [r for r in read_records(Path(workdir) / "logs" / "metrics_gpu0.jsonl")
            if r.get("event") == "checkpoint"]


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_relaunch_after_kill_9_resumes_from_the_final_save_on_the_hub(tmp_path, launchers):
    with local_cluster(nodes=1, devices_per_node=1) as cluster:
        pod = make_pod(tmp_path, ray={"address": cluster.address, "resource": RESOURCE,
                                      "fence_s": FENCE_S},
                       save_keep=1000, stop_grace_s=8.0)
        launcher = Launcher(pod, "--stage", "1", "--gpus", "0")
        launchers.append(launcher)
        (placed,) = wait_for(lambda: events_of(pod, "worker_placed", gpu=0), STARTUP_S,
                             "the worker placed on the node")
        wait_for(lambda: worker_records(pod, 0, "checkpoint"), STARTUP_S, "a checkpoint")

        killed = time.time()
        os.kill(launcher.proc.pid, signal.SIGKILL)
        wait_for(lambda: gone(placed["pid"]), 120, "the fenced worker's exit")
        final = node_checkpoints(placed["workdir"])[-1]        # its save on SIGTERM
        lineage = json.loads((pod / RAY_LINEAGE_FILE).read_text())["0"]   # its start
        hub = f"file://{pod / 'hub'}"

        def pushed():
            copy = read_recovery_copy(hub, pod, CKPT, 0, lineage)
            return copy if copy and copy["sha256"] == final["sha256"] else None

        wait_for(pushed, 300, "the final save's recovery copy on the hub")
        before = manifest_json(pod)["gpu_0"]["start_token"]
        assert before < final["next_token"]       # the manifest never saw the final save

        relaunch = Launcher(pod, "--stage", "1", "--gpus", "0")
        launchers.append(relaunch)
        (used,) = wait_for(lambda: [e for e in events_of(pod, "recovery_copy", gpu=0)
                                    if e["ts"] > killed], STARTUP_S, "the recovery copy taken")
        assert (used["next_token"], used["passed_token"]) == (final["next_token"], before)
        (start,) = wait_for(lambda: [e for e in events_of(pod, "worker_start", gpu=0)
                                     if e["ts"] > killed], STARTUP_S, "the relaunch's start")
        assert start["start_token"] == final["next_token"]
        assert start["checkpoint"] == recovery_path(CKPT)
        (again,) = wait_for(lambda: [e for e in events_of(pod, "worker_placed", gpu=0)
                                     if e["ts"] > killed], STARTUP_S, "placed again")
        resumed = wait_for(lambda: [r for r in worker_records(pod, 0, "start")
                                    if r["ts"] > again["ts"]], STARTUP_S, "training again")
        assert resumed[0]["next_token"] == final["next_token"]
        relaunch.cleanup()
