"""The split of issue 17: a worker backend that runs processes only, and one checkpoint
custodian that owns a checkpoint once written and the run's hub lease.

RayCustodian is driven here without a cluster (tests/support/ray_stub.py: its actors answer
at once); the real cluster is tests/test_ray_*.py's.
"""

import ast
import inspect
from pathlib import Path

from launcher.hub.lease import RunTakenOver
from launcher.hub.sync_state import read_sync_state
from launcher.pod.ckpt_index import CheckpointIndex
from launcher.supervise.backend import WorkerBackend
from launcher.supervise.ray.copies import RayCustodian
from tests.support.fake_supervisor import (  # noqa: F401 (fixtures)
    events,
    make,
    passed_checkpoint,
    pod_template,
)
from tests.support.ray_stub import StubActor, StubRayBackend

PROCESS_METHODS = {"start", "poll", "settling", "signal", "kill", "stop", "close", "pump",
                   "can_place", "metrics_file", "log_file"}


def test_a_worker_backend_runs_processes_and_knows_nothing_of_checkpoints():
    public = {name for name, _ in inspect.getmembers(WorkerBackend)
              if not name.startswith("_")} - {"name"}
    assert public == PROCESS_METHODS


def ray_pod(make):
    """A real supervisor whose checkpoints are kept by RayCustodian over stub nodes."""
    sup, backend, clock = make(stage=1)
    nodes = StubRayBackend(sup.pod.pod_dir, sup.pod.plan.config, sup.pod.events)
    custodian = RayCustodian(nodes, nodes)
    sup.use_backend(backend, custodian)
    sup.starter.start_all()
    return sup, backend, nodes, custodian


def passed_not_pushed(sup, backend) -> None:
    """GPU 0's checkpoint passes and is queued for its node's push; no round trip yet."""
    backend.train(0, 50)
    backend.checkpoint(0)
    backend.train(0, 51)
    sup.monitor.drain(sup.pod.runs[0])


def test_a_passed_checkpoint_is_pushed_by_its_node_and_noted_in_the_manifest(make):
    sup, backend, nodes, custodian = ray_pod(make)
    event = passed_checkpoint(sup, backend, 0)
    custodian.pump(force=True)                  # its next round trip to the nodes
    sup.step()
    (pushed,) = nodes.actors[0].pushes
    assert pushed[0] == event["sha256"] and pushed[1] == sup.pod.plan.config.checkpoint_path(0)
    assert custodian.hub_copy(0)["hub_revision"] == "rev-1"
    assert sup.pod.manifest.entries[0].hub_revision == "rev-1"
    (noted,) = events(sup, "sync_pushed", reason="node")
    assert (noted["node"], noted["hub_revision_for"]) == ("node-0", [0])


def test_a_passed_checkpoint_of_a_lost_node_is_never_pushed_from_its_next_node(make):
    sup, backend, nodes, custodian = ray_pod(make)
    passed_not_pushed(sup, backend)
    assert custodian.queued
    nodes.lose(0)
    nodes.actors[0] = StubActor()               # the GPU placed again, on another node
    custodian.pump(force=True)
    assert nodes.actors[0].pushes == [] and custodian.hub_copy(0) is None


def test_the_run_has_one_lease_a_refused_node_push_stops_the_sync_at_once(make):
    """A node's push refused by a takeover is recorded once, in the lease the hub sync
    reads: the sync pushes nothing more, with no reconciling turn of the loop between."""
    sup, backend, nodes, custodian = ray_pod(make)
    assert sup.pod.custodian.sync.lease is custodian.lease
    nodes.actors[0].answer = RunTakenOver("run taken over by pod B")
    passed_checkpoint(sup, backend, 0)
    custodian.pump(force=True)
    assert sup.pod.custodian.sync.taken_over == "run taken over by pod B"
    (taken,) = events(sup, "hub_taken_over")
    assert taken["reason"] == "node push"
    assert read_sync_state(sup.pod.pod_dir)["taken_over"] == "run taken over by pod B"
    backend.train(0, 50)
    backend.checkpoint(0)
    backend.train(0, 60)
    for _ in range(3):
        sup.step()
    assert len(nodes.actors[0].pushes) == 1 and len(events(sup, "hub_taken_over")) == 1


def test_a_sync_push_refused_stops_the_node_pushes_too(make):
    sup, backend, nodes, custodian = ray_pod(make)
    passed_not_pushed(sup, backend)
    sup.pod.custodian.sync.lease.refused("run taken over by pod B", "manifest")
    custodian.pump(force=True)
    assert nodes.actors[0].pushes == [] and not custodian.queued
    (taken,) = events(sup, "hub_taken_over")
    assert taken["reason"] == "manifest"


# The checkpoint index's methods that write it (a new method is classified below first).
INDEX_WRITES = {"add", "mark", "retain_file", "_append", "_retain", "_prune"}
INDEX_READS = {"for_gpu", "pending", "newest_passed", "file_sha256", "copies_of",
               "_retained_path"}
# Where the index is written: the custodian and the helpers it calls with its own index;
# elsewhere, a Ray node's own index of its disk and the rollback by hand (no launcher runs).
WRITES_INDEX = {"launcher/supervise/custodian.py", "launcher/hub/recover.py",
                "launcher/pod/failed_resume.py", "launcher/pod/decided_rollback.py",
                "launcher/hub/snapshot.py", "launcher/hub/sync.py",
                "launcher/supervise/ray/copies.py", "launcher/pod/ckpt_index.py",
                "launcher/supervise/ray/node_checkpoints.py", "launcher/cli/rollback_probe.py"}
# Who opens one: the custodian, that node, the rollback by hand, and read-only views.
OPENS_INDEX = {"launcher/supervise/custodian.py", "launcher/supervise/ray/node_checkpoints.py",
               "launcher/cli/rollback_probe.py", "launcher/dashboard/status.py",
               "launcher/dashboard/status_checkpoints.py", "launcher/hub/retention.py",
               "launcher/hub/sync_push.py"}


def _index_writers() -> list[str]:
    """`x.add(...)` etc. on an index (`x` named *index*), or `CheckpointIndex(...)`, in
    launcher/ outside the files allowed to."""
    root = Path(__file__).resolve().parents[1]
    found = []
    for path in sorted((root / "launcher").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if (isinstance(func, ast.Attribute) and func.attr in INDEX_WRITES
                    and ast.unparse(func.value).split(".")[-1].lower().endswith("index")
                    and rel not in WRITES_INDEX):
                found.append(f"{rel}:{node.lineno} {ast.unparse(func)}")
            if ast.unparse(func).split(".")[-1] == "CheckpointIndex" and rel not in OPENS_INDEX:
                found.append(f"{rel}:{node.lineno} {ast.unparse(func)}()")
    return found


def test_only_the_custodian_writes_the_checkpoint_index():
    """Issue 27 item 1: the launch's preparation (reconcile, a decided rollback, never
    resuming a failed checkpoint, recovery) is the custodian's too, before the supervisor."""
    methods = {name for name, _ in inspect.getmembers(CheckpointIndex, inspect.isfunction)}
    assert methods - {"__init__"} == INDEX_WRITES | INDEX_READS
    assert _index_writers() == []
