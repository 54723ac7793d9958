"""A Ray pod's restarts start from exact bytes, without a cluster: a node starts its worker
only from the bytes its manifest entry records (its own copy when a final save was written
over the named file), and a launch after the launcher's kill -9 resumes each GPU from its
last worker start's recovery copy when newer than its manifest entry.

The node is the real NodeWorker (its Ray context stubbed) starting a real child process;
the hub a real file:// store written by the real recovery pusher; the launcher's side the
real RayBackend bookkeeping and `resume_newer_copies` as `launch` calls it."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from launcher.config.devices import Slot
from launcher.config.podconfig import load_pod_config
from launcher.files import sha256_file
from launcher.hub.lease import pod_id
from launcher.pod.ckpt_index import CheckpointIndex
from launcher.pod.decided_rollback import record_decision
from launcher.pod.events import EventLog, read_events
from launcher.pod.manifest import apply_checkpoint, read_manifest, write_manifest
from launcher.pod.setup_init import init_pod
from launcher.supervise.custodian import CheckpointCustodian
from launcher.supervise.plan import load_plan
from launcher.supervise.ray.driver import RayBackend, RayHandle
from launcher.supervise.ray.starts import GpuStarts
from launcher.supervise.ray.copies import resume_newer_copies
from launcher.supervise.ray.recovery import RecoveryPusher, recovery_path
from launcher.worker.process import WorkerSpec

CKPT = "checkpoints/fractus_1b_gpu{gpu}.pt"


def save(workdir: Path, gpu: int, token: int) -> dict:
    """A save of `gpu` at `token` written as the worker does (a rename over its one name),
    and its checkpoint event."""
    path = workdir / CKPT.format(gpu=gpu)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"model_state": {"w": torch.full((4,), float(token))}, "config": {"gpu": gpu},
                "train_state": {"gpu": gpu, "next_token": token, "run_id": "run-a"},
                "optimizer_state": {}}, tmp)
    tmp.replace(path)
    return {"type": "event", "event": "checkpoint", "path": str(path), "sha256": sha256_file(path),
            "next_token": token, "step": token // 32, "ema_tf": 5.0, "lb": 0.1,
            "ts": time.time()}


# ---- the node: a restart starts from the bytes its entry records -------------------------
@pytest.fixture
def node(tmp_path, monkeypatch):
    """A real NodeWorker (Ray's context stubbed: no cluster) whose 'worker' writes down the
    checkpoint it was told to resume from, with that file's sha256."""
    import ray

    from launcher.supervise.ray.node import NodeWorker
    monkeypatch.setattr(ray, "get_runtime_context", lambda: SimpleNamespace(
        get_node_id=lambda: "a1b2c3d4e5f6" * 4))
    worker = ("import hashlib, json, os; p = os.environ['CKPT_IN']; json.dump({'path': p, "
              "'sha256': hashlib.sha256(open(p, 'rb').read()).hexdigest()}, "
              "open('resumed.json', 'w'))")
    return NodeWorker(0, str(tmp_path / "node"), str(tmp_path / "pod"), None, None,
                      [sys.executable, "-c", worker], fence_s=3600.0, grace_s=5.0)


def start_from(node, entry: dict, token: int) -> dict:
    """The launcher's restart of GPU 0 from `entry` (path, sha256, revision) at `token`;
    what the node answered, and what its worker resumed from."""
    settings = {"METRICS": "logs/metrics_gpu0.jsonl", "START_TOKEN": str(token),
                "CKPT_IN": entry["path"], "RUN_ID": "run-a"}
    info = node.start(settings, entry, False)
    node.host.proc.wait(timeout=60)
    return {**info, **json.loads((node.workdir / "resumed.json").read_text())}


def test_a_restart_after_a_final_save_over_its_file_starts_from_the_recorded_bytes(node):
    """The race of a rollback on a Ray pod: a passing GPU stopped gracefully writes its
    final save over its checkpoint's name, and is restarted from its manifest entry, which
    still names the older save (its event not yet in the manifest). The node had the
    recorded bytes (retained when their event was read) but kept the newer file: the worker
    refused the older start token on it and the pod failed. It now starts from the node's
    copy of exactly the recorded bytes, as one machine does."""
    older = save(node.workdir, 0, 1_971_200)
    node.ckpts.seen(json.dumps(older).encode())            # its event read: retained on the node
    final = save(node.workdir, 0, 1_972_096)            # the final save on SIGTERM, same name
    node.ckpts.seen(json.dumps(final).encode())
    entry = {"path": CKPT.format(gpu=0), "sha256": older["sha256"], "revision": None}
    started = start_from(node, entry, 1_971_200)
    assert started["sha256"] == older["sha256"]
    assert started["path"].startswith("checkpoints/retained/")
    assert started["recovered"] == started["path"] and not started["pulled"]
    assert sha256_file(node.workdir / CKPT.format(gpu=0)) == final["sha256"]   # kept as is


def test_a_restart_whose_recorded_bytes_are_nowhere_fails_its_start_in_one_line(node):
    """Never a worker on other bytes than its entry records: its start fails, one line (a
    crash the restart policy handles), instead of a worker that refuses them."""
    save(node.workdir, 0, 160)                         # no event read, no copy, no hub
    entry = {"path": CKPT.format(gpu=0), "sha256": "0" * 64, "revision": None}
    with pytest.raises(FileNotFoundError) as refused:
        node.start({"METRICS": "logs/metrics_gpu0.jsonl", "START_TOKEN": "160",
                    "CKPT_IN": entry["path"]}, entry, False)
    (line,) = str(refused.value).splitlines()
    assert CKPT.format(gpu=0) in line and "holds other bytes" in line
    assert node.host.proc is None                       # no worker started


# ---- the launcher: a relaunch after kill -9 resumes from the newest copy -----------------
class PlacingRay:
    """What RayBackend._placed asks of Ray: each start answers at once with `infos`."""

    def __init__(self, infos):
        self.infos = infos

    def wait(self, refs, num_returns=1, timeout=None):
        return list(refs), []

    def get(self, ref):
        return self.infos[ref]


def first_launcher(pod: Path, placed: dict[int, str]) -> RayBackend:
    """The bookkeeping of the launcher that was killed: each GPU's start answered with the
    attempt its node gave it (RayBackend._placed), as on the cluster."""
    backend = object.__new__(RayBackend)
    backend.pod_dir, backend.handles = pod, {}
    backend.starts = GpuStarts(pod, load_pod_config(pod))
    backend.events = EventLog(pod)
    backend.heartbeat = SimpleNamespace(heard=lambda actor: None)
    backend.ray = PlacingRay({f"start-{g}": {"pid": 100 + g, "node": f"node-{g}",
                                             "node_id": f"id-{g}", "workdir": "w",
                                             "fetched": [], "pulled": False, "attempt": a}
                              for g, a in placed.items()})
    handles = [RayHandle(g, None, None, call=f"start-{g}") for g in placed]
    backend.handles = {h.gpu: h for h in handles}
    backend._placed(handles)
    return backend


def recovery_copy(tmp_path: Path, pod: Path, gpu: int, token: int, attempt: str) -> dict:
    """The node's pusher of worker start `attempt` pushes a save of `gpu` at `token` to the
    pod's hub (as after its node fenced the worker: its final save)."""
    workdir = tmp_path / f"node{gpu}"
    event = save(workdir, gpu, token)
    pusher = RecoveryPusher({"gpu": gpu, "workdir": str(workdir), "metrics": "m.jsonl",
                             "offset": 0, "hub_url": f"file://{pod / 'hub'}",
                             "writer": pod_id(pod), "attempt": attempt, "run_id": "run-a",
                             "node": f"node-{gpu}"})
    pusher.waiting = ({**event, "path": CKPT.format(gpu=gpu)}, Path(event["path"]))
    assert pusher._push_waiting()
    return event


@pytest.fixture
def killed_pod(tmp_path):
    """A Ray pod of 3 GPUs whose launcher was killed with -9: each manifest entry at its
    passed copy (token 32,000); the nodes fenced their workers, which saved and pushed
    their final saves as recovery copies (token 40,000). GPU 1's last worker was killed by
    its launcher (a failed check), GPU 2's copy is of an older start than its last."""
    pod = tmp_path / "pod"
    init_pod(pod, "tiny-cpu")
    config = load_pod_config(pod)
    manifest = read_manifest(pod / config.manifest)
    for gpu in (0, 1, 2):
        passed = save(pod, gpu, 32_000)
        apply_checkpoint(manifest, gpu, passed, 2, pod, config.shard_path(gpu))
    write_manifest(manifest)
    backend = first_launcher(pod, {0: "start-a0", 1: "start-a1", 2: "start-b2"})
    backend._finish = lambda handles, call, answer_s=0: {h.gpu: None for h in handles}
    backend.kill(backend.handles[1])
    finals = {0: recovery_copy(tmp_path, pod, 0, 40_000, "start-a0"),
              1: recovery_copy(tmp_path, pod, 1, 40_000, "start-a1"),
              2: recovery_copy(tmp_path, pod, 2, 40_000, "start-a2")}
    plan, _ = load_plan(pod, 2, "cpu:3", None, ray_address="127.0.0.1:6379")  # as `launch`
    return plan, finals


def relaunch(plan):
    manifest = read_manifest(plan.pod_dir / plan.config.manifest)
    taken = resume_newer_copies(plan, CheckpointCustodian.for_plan(plan, manifest,
                                                                   EventLog(plan.pod_dir)))
    return taken, manifest, read_manifest(plan.pod_dir / plan.config.manifest)


def test_a_relaunch_after_kill_9_resumes_each_gpu_from_its_newer_recovery_copy(killed_pod):
    """The final saves already on the hub were thrown away: every GPU resumed from its
    manifest's older passed copy, 37.7-55.7 save intervals retrained. Now a GPU whose last
    worker start pushed a newer copy resumes from it (its node checks it again before the
    worker starts); a GPU whose worker was killed, or whose copy is of another start, from
    its manifest's copy."""
    plan, finals = killed_pod
    taken, manifest, written = relaunch(plan)
    assert list(taken) == [0] and taken[0].start_token == 32_000   # a rollback's target
    entry = written.entries[0]
    assert (entry.start_token, entry.checkpoint, entry.checkpoint_sha256) == \
        (40_000, recovery_path(CKPT.format(gpu=0)), finals[0]["sha256"])
    assert entry.hub_revision and entry.stage == 2
    assert [written.entries[g].start_token for g in (1, 2)] == [32_000, 32_000]
    (said,) = [e for e in read_events(plan.pod_dir) if e["event"] == "recovery_copy"]
    assert (said["gpu"], said["next_token"], said["passed_token"]) == (0, 40_000, 32_000)
    # The first start of the relaunch continues that lineage (a node lost before it answers
    # resumes from that copy again, not from the older passed one).
    backend = object.__new__(RayBackend)
    backend.pod_dir, backend.handles, backend.slots = plan.pod_dir, {}, {}
    backend.config, backend.starts = plan.config, GpuStarts(plan.pod_dir, plan.config)
    backend.actors = {0: SimpleNamespace(start=SimpleNamespace(remote=lambda *a: object()))}
    backend.start(WorkerSpec(Slot(0, "cpu"), {}, start_token=40_000, ckpt_in=entry.checkpoint))
    assert backend.starts.attempt(0) == "start-a0"


def test_a_relaunch_never_takes_a_copy_of_a_decided_rollback_or_one_marked_failed(killed_pod):
    plan, finals = killed_pod
    record_decision(plan.pod_dir, [0], 3, 2, "GPU 0: loss spike", True)
    taken, _, written = relaunch(plan)
    assert not taken and written.entries[0].start_token == 32_000
    (plan.pod_dir / "logs" / "rollback_decided.json").unlink()
    index = CheckpointIndex(plan.pod_dir)
    index.add(0, finals[0], 3, recovery_path(CKPT.format(gpu=0)), verdict="failed")
    taken, _, written = relaunch(plan)
    assert not taken and written.entries[0].start_token == 32_000
