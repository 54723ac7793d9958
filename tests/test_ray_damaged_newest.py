"""On a Ray pod, a GPU's newest checkpoint damaged on its node where no copy of its bytes is
left (written in place: its retained link shares the inode; not passed, so not on the hub)
does not stop the pod: its node's start fails (the bytes are nowhere), and the launcher
decides as on one machine (tests/test_damaged_newest.py): the GPU goes back to its newest
passed checkpoint by itself, at its stage, said in a `rollback` event (an alert) and the
manifest written before the next start, which resumes from exactly those bytes.

The node is the real NodeWorker (Ray's context stubbed: no cluster) starting a real child
process; the launcher's side the real RayBackend bookkeeping of a start's answer (a node's
exception arrives as Ray delivers it, a RayTaskError carrying it) and the real
RayCustodian.restore the supervisor calls before a restart."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest

from launcher.config.devices import Slot
from launcher.config.podconfig import load_pod_config
from launcher.hub.recover import RecoveryError
from launcher.pod.ckpt_index import FAILED, PASSED, CheckpointIndex
from launcher.pod.events import EventLog, read_events
from launcher.pod.manifest import apply_checkpoint, read_manifest, write_manifest
from launcher.pod.setup_init import init_pod
from launcher.supervise.ray.driver import RayBackend
from launcher.supervise.ray.copies import RayCustodian
from launcher.supervise.ray.starts import GpuStarts
from launcher.worker.process import WorkerSpec
from tests.support.saves import write_save

CKPT = "checkpoints/fractus_1b_gpu0.pt"

WORKER = ("import hashlib, json, os; p = os.environ['CKPT_IN']; json.dump({'path': p, "
          "'token': os.environ['START_TOKEN'], "
          "'sha256': hashlib.sha256(open(p, 'rb').read()).hexdigest()}, "
          "open('resumed.json', 'w'))")


@pytest.fixture
def node(tmp_path, monkeypatch):
    import ray

    from launcher.supervise.ray.node import NodeWorker
    monkeypatch.setattr(ray, "get_runtime_context", lambda: SimpleNamespace(
        get_node_id=lambda: "a1b2c3d4e5f6" * 4))
    return NodeWorker(0, str(tmp_path / "node"), str(tmp_path / "pod"), None, None,
                      [sys.executable, "-c", WORKER], fence_s=3600.0, grace_s=5.0)


def launcher_of(pod, node) -> tuple[RayBackend, RayCustodian]:
    """The launcher's RayBackend and RayCustodian, GPU 0's actor `node`: a start answers at
    once, a node's exception as Ray hands it to the driver (a RayTaskError with its cause)."""
    import ray
    answers = {}

    def start(*args):
        try:
            answers["start"] = node.start(*args)
        except Exception as exc:           # as Ray delivers an actor method's exception
            answers["start"] = ray.exceptions.RayTaskError("start", "", exc) \
                .as_instanceof_cause()
        return "start"

    def get(ref):
        if isinstance(answers[ref], Exception):
            raise answers[ref]
        return answers[ref]
    backend = object.__new__(RayBackend)
    backend.pod_dir, backend.handles, backend.slots = pod, {}, {}
    backend.config, backend.events = load_pod_config(pod), EventLog(pod)
    backend.starts = GpuStarts(pod, backend.config)
    backend.heartbeat = SimpleNamespace(heard=lambda actor: None)
    backend.ray = SimpleNamespace(wait=lambda refs, num_returns=1, timeout=None: (refs, []),
                                  get=get, exceptions=ray.exceptions)
    backend.actors = {0: SimpleNamespace(start=SimpleNamespace(remote=start))}
    custodian = object.__new__(RayCustodian)
    custodian.backend, custodian.events, custodian.pod_dir = backend, backend.events, pod
    custodian.config, custodian.on_hub, custodian.starts = backend.config, {}, backend.starts
    return backend, custodian


def start_gpu0(backend, node, pod) -> dict | None:
    """GPU 0's start from its manifest entry (as WorkerStarter.spec makes it): what its
    worker resumed from, or None when the start failed on its node."""
    entry = read_manifest(pod / load_pod_config(pod).manifest).entries[0]
    node.host.proc = None
    handle = backend.start(WorkerSpec(Slot(0, "cpu"), {}, start_token=entry.start_token,
                                      ckpt_in=entry.checkpoint, stage=entry.stage,
                                      ckpt_sha256=entry.checkpoint_sha256,
                                      ckpt_revision=entry.hub_revision))
    backend._placed([handle])
    if handle.ended is not None:
        return None
    assert node.host.proc.wait(timeout=60) == 0
    return json.loads((node.workdir / "resumed.json").read_text())


@pytest.fixture
def damaged(tmp_path, node):
    """GPU 0 on its node: a passed checkpoint (token 160), then a newer one (token 320)
    that the manifest names, not yet judged, damaged in place on the node's disk."""
    pod = tmp_path / "pod"
    init_pod(pod, "tiny-cpu")
    config = load_pod_config(pod)
    manifest, index = read_manifest(pod / config.manifest), CheckpointIndex(pod)
    for token, verdict in ((160, PASSED), (320, "pending")):
        event = write_save(node.workdir, 0, token)
        node.ckpts.seen(json.dumps(event).encode())                # retained on the node
        index.add(0, event, 3, CKPT, verdict=verdict)          # its event on the launcher
        apply_checkpoint(manifest, 0, event, 3, pod, config.shard_path(0))
    write_manifest(manifest)
    with open(node.workdir / CKPT, "r+b") as f:              # its retained link too
        f.write(b"\0\0\0\0")
    return pod, index


def test_a_damaged_newest_checkpoint_on_a_node_goes_back_to_the_newest_passed_one(
        node, damaged):
    """Seen: on Ray the node refused the start (the recorded bytes nowhere) at every restart
    until the GPU was given up; the fallback to the newest passed checkpoint did not reach
    a Ray pod. Now the launcher decides it, recorded before the next start."""
    pod, index = damaged
    passed, lost = (r for r in index.for_gpu(0))
    backend, custodian = launcher_of(pod, node)
    assert start_gpu0(backend, node, pod) is None              # nowhere on its node
    (failed,) = [e for e in read_events(pod) if e["event"] == "worker_start_failed"]
    assert "BytesNowhere" in failed["error"]

    manifest = read_manifest(pod / load_pod_config(pod).manifest)
    assert custodian.restore(0, manifest, CheckpointIndex(pod))   # before the restart
    (rolled,) = [e for e in read_events(pod) if e["event"] == "rollback"]
    assert (rolled["from_token"], rolled["to_token"]) == (320, 160)
    assert rolled["from_stage"] == rolled["to_stage"] == 3 and rolled["automatic"]
    assert "holds other bytes on node" in rolled["reason"]
    written = read_manifest(pod / load_pod_config(pod).manifest).entries[0]   # written already
    assert (written.start_token, written.checkpoint_sha256) == (160, passed["sha256"])
    assert CheckpointIndex(pod).records[(0, lost["sha256"])]["verdict"] == FAILED

    resumed = start_gpu0(backend, node, pod)        # the restart: the passed bytes, exactly
    assert (resumed["token"], resumed["sha256"]) == ("160", passed["sha256"])
    assert not custodian.restore(0, manifest, CheckpointIndex(pod))   # nothing more to do


def test_with_no_passed_checkpoint_left_the_pod_fails_in_one_line(node, damaged):
    pod, index = damaged
    passed = index.for_gpu(0)[0]
    index.mark(0, passed["sha256"], FAILED, "a later check failed")
    backend, custodian = launcher_of(pod, node)
    assert start_gpu0(backend, node, pod) is None
    manifest = read_manifest(pod / load_pod_config(pod).manifest)
    with pytest.raises(RecoveryError) as refused:
        custodian.restore(0, manifest, CheckpointIndex(pod))
    (line,) = str(refused.value).splitlines()
    assert "no passed checkpoint of it is left on its node or the hub" in line
    assert not [e for e in read_events(pod) if e["event"] == "rollback"]
