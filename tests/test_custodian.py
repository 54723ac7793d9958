"""The split of issue 17: a worker backend that runs processes only, and one checkpoint
custodian that owns a checkpoint once written and the run's hub lease.

RayCustodian is driven here without a cluster (tests/support/ray_stub.py: its actors answer
at once); the real cluster is tests/test_ray_*.py's.
"""

import inspect

from launcher.hub.lease import RunTakenOver
from launcher.hub.sync_state import read_sync_state
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
