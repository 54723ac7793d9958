"""Recovery copies of a Ray pod (launcher/supervise/ray/recovery.py) without a cluster: the
node's pusher pushes each save of its worker at once, and the final one written after the
worker ended, then exits; the launcher takes only its lost worker's copy, checked."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from launcher.hub import open_store
from launcher.hub.lease import pod_id
from launcher.files import sha256_file
from launcher.supervise.ray.recovery import (RecoveryPusher, check_save, check_save_apart,
                                             read_recovery_copy, recovery_path)
from tests.support.e2e import wait_for

CKPT = "checkpoints/fractus_1b_gpu0.pt"


def save(workdir: Path, token: int, value: float = 1.0) -> dict:
    """A checkpoint of GPU 0 at `token` written as the worker does (rename), and its event."""
    path = workdir / CKPT
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"model_state": {"w": torch.full((4,), value)}, "config": {"gpu": 0},
                "train_state": {"gpu": 0, "next_token": token, "run_id": "run-a"},
                "optimizer_state": {}}, tmp)
    tmp.replace(path)
    return {"type": "event", "event": "checkpoint", "path": str(path),
            "sha256": sha256_file(path), "next_token": token, "ts": time.time()}


def append(metrics: Path, record: dict) -> None:
    with open(metrics, "a") as f:
        f.write(json.dumps(record) + "\n")


@pytest.fixture
def node(tmp_path):
    """A node's workdir with a 'worker' (a sleeping process) and its pusher on a thread."""
    workdir, hub = tmp_path / "node", f"file://{tmp_path / 'hub'}"
    metrics = workdir / "logs" / "metrics_gpu0.jsonl"
    metrics.parent.mkdir(parents=True)
    metrics.write_text(json.dumps({"type": "event", "event": "start"}) + "\n")
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    spec = {"gpu": 0, "workdir": str(workdir), "metrics": "logs/metrics_gpu0.jsonl",
            "offset": metrics.stat().st_size, "pid": worker.pid,
            "create_time": psutil.Process(worker.pid).create_time(), "hub_url": hub,
            "writer": pod_id(tmp_path / "pod"), "attempt": "attempt-1", "run_id": "run-a",
            "node": "node-a"}
    pusher = threading.Thread(target=RecoveryPusher(spec).run, daemon=True)
    pusher.start()
    yield workdir, metrics, worker, pusher, hub
    worker.kill()
    worker.wait()
    pusher.join(timeout=60)


def test_each_save_and_the_final_one_reach_the_hub_before_any_probe(tmp_path, node):
    workdir, metrics, worker, pusher, hub = node
    store = open_store(hub, tmp_path / "reader")

    def on_hub() -> str | None:
        head = store.head()
        entry = store.files(head).get(recovery_path(CKPT)) if head else None
        return entry.sha256 if entry else None

    first = save(workdir, 160)
    append(metrics, first)
    wait_for(lambda: on_hub() == first["sha256"], 60, "the first save's recovery copy")
    # A save holding NaN is not pushed (the cheap checks): the hub keeps the last good one.
    bad = save(workdir, 320, float("nan"))
    append(metrics, bad)
    # SIGTERM (a graceful removal): the worker writes its final save and its line, and ends.
    final = save(workdir, 480)
    append(metrics, final)
    worker.terminate()
    worker.wait()
    pusher.join(timeout=120)
    assert not pusher.is_alive(), "the pusher outlived its pushes"
    assert on_hub() == final["sha256"]
    assert bad["sha256"] not in {e.sha256 for e in store.files(store.head()).values()}
    pod = tmp_path / "pod"
    copy = read_recovery_copy(hub, pod, CKPT, 0, "attempt-1")
    assert copy["next_token"] == 480 and copy["sha256"] == final["sha256"]
    assert copy["path"] == recovery_path(CKPT) and copy["hub_revision"] == store.head()
    # Only the lost worker's start: another start's copy (a rolled-back lineage) is not it.
    assert read_recovery_copy(hub, pod, CKPT, 0, "attempt-2") is None
    assert read_recovery_copy(hub, pod, CKPT, 1, "attempt-1") is None


@pytest.mark.parametrize("check", [check_save, check_save_apart])
def test_check_save_refuses_another_gpus_run_or_token_and_non_finite_weights(tmp_path, check):
    """In the process that asks (the pusher) and apart, in a child (a node actor, which must
    not load torch's libraries itself: its heartbeats would go unheard meanwhile)."""
    event = save(tmp_path, 160)
    path = Path(event["path"])
    check(path, 0, "run-a", 160)
    for gpu, run, token, words in ((1, "run-a", 160, "not GPU 1"), (0, "run-b", 160, "run"),
                                   (0, "run-a", 320, "token")):
        with pytest.raises(ValueError, match=words):
            check(path, gpu, run, token)
    save(tmp_path, 160, float("inf"))
    with pytest.raises(ValueError, match="NaN/Inf"):
        check(path, 0, "run-a", 160)


def test_a_save_that_does_not_load_is_refused_apart_in_one_line(tmp_path):
    path = tmp_path / "recovery" / CKPT
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError) as refused:
        check_save_apart(path, 0, "run-a", 160)
    (line,) = str(refused.value).splitlines()
    assert "fractus_1b_gpu0.pt" in line and "load" in line and "Traceback" not in line


def test_a_lost_gpu_resumes_from_the_newer_of_its_passed_and_its_recovery_copy(tmp_path):
    """RayCustodian.resume_copy (over stub nodes) on a real file:// hub: the recovery copy of
    the lost worker's start when newer than the passed copy, else the passed copy; a copy of
    another start never."""
    from types import SimpleNamespace

    from launcher.pod.events import EventLog, read_events
    from launcher.supervise.ray.copies import RayCustodian
    from tests.support.ray_stub import StubRayBackend
    hub, workdir, pod = f"file://{tmp_path / 'hub'}", tmp_path / "node", tmp_path / "pod"
    pusher = RecoveryPusher({"gpu": 0, "workdir": str(workdir), "metrics": "m.jsonl",
                             "offset": 0, "hub_url": hub, "writer": pod_id(pod),
                             "attempt": "attempt-1", "run_id": "run-a", "node": "node-a"})
    event = save(workdir, 480)
    pusher.waiting = ({**event, "path": CKPT}, Path(event["path"]))
    assert pusher._push_waiting()

    pod.mkdir(exist_ok=True)
    backend = StubRayBackend(pod, SimpleNamespace(checkpoint_path=lambda gpu: CKPT),
                             EventLog(pod), hub_url=hub)
    custodian = RayCustodian(backend, backend)
    backend.attempts[0] = "attempt-1"
    for passed_token, served in ((320, 480), (640, 640), (None, 480)):
        custodian.on_hub = {0: {"next_token": passed_token, "sha256": "p" * 64,
                                "path": CKPT, "hub_revision": "r"}} if passed_token else {}
        assert custodian.resume_copy(0)["next_token"] == served
    used = [e for e in read_events(pod) if e["event"] == "recovery_copy"]
    assert [e["passed_token"] for e in used] == [320, None]
    backend.attempts[0] = "attempt-2"          # a later start of the GPU lost it
    assert custodian.resume_copy(0) is None


def test_a_start_lost_before_it_answers_keeps_the_lineage_it_resumed(tmp_path):
    """A GPU resuming from its recovery copy whose new node goes away before the start
    answers (seen under load: a removed node still took the actor) resumes from that copy
    again, not from its older passed one; a rollback's start carries no lineage."""
    from launcher.config.devices import Slot
    from launcher.config.podconfig import load_pod_config
    from launcher.pod.setup_init import init_pod
    from launcher.supervise.ray.driver import RayBackend
    from launcher.supervise.ray.starts import GpuStarts
    from launcher.worker.process import WorkerSpec

    class Actor:                         # start() only submits: the answer never comes
        def __init__(self):
            self.start = self

        def remote(self, *args):
            return object()

    pod = tmp_path / "pod"
    init_pod(pod, "tiny-cpu")
    backend = object.__new__(RayBackend)             # RayBackend.start's bookkeeping only
    backend.config, backend.slots, backend.pod_dir, backend.handles = \
        load_pod_config(pod), {}, pod, {}
    backend.starts = GpuStarts(pod, backend.config)
    backend.starts.started(0, "attempt-1")             # the lost worker's start answered
    backend.actors = {0: Actor()}
    recovery = WorkerSpec(Slot(0, "cpu"), {}, start_token=72192,
                          ckpt_in="recovery/checkpoints/fractus_1b_gpu0.pt")
    backend.start(recovery)
    assert backend.starts.attempt(0) == "attempt-1"    # not answered: still that lineage
    backend.start(recovery)                            # and again, lost once more
    assert backend.starts.attempt(0) == "attempt-1"
    backend.start(WorkerSpec(Slot(0, "cpu"), {}, start_token=31680,   # a rollback's start
                             ckpt_in="checkpoints/fractus_1b_gpu0.pt"))
    assert backend.starts.attempt(0) is None
