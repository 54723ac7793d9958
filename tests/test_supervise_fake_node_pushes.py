"""Hub pushes on a remote backend (Ray's nodes), driven through a fake backend: no processes,
a fake clock (tests/support/fake_supervisor.py).

The nodes push the checkpoints; the launcher notes each node push in the manifest and pushes
the manifest after it to a real local store, so that `--from-hub` onto a cluster resumes at
the pushed tokens (and skips a revision left mid-push); a takeover refusing a node's push
stops every push; a failed manifest push is retried at the interval, not on every poll.
"""

import pytest

import launcher.hub.snapshot as snapshot_module
from launcher.hub import IntegrityError, open_store
from launcher.hub.from_hub import rebuild_from_hub
from launcher.hub.lease import RunTakenOver, pod_id, take_over
from launcher.hub.sync_state import read_sync_state
from launcher.pod.ckpt_index import PASSED
from launcher.pod.events import read_events
from launcher.pod.manifest import read_manifest
from launcher.supervise.ray.node_checkpoints import push_as_pod
from tests.support.fake_supervisor import (  # noqa: F401 (fixtures)
    events,
    make,
    on_nodes,
    passed_checkpoint,
    pod_template,
    step_until,
)


def test_a_node_push_notes_its_hub_revision_where_the_manifest_names_those_bytes(make):
    sup, backend, clock = make(nodes={"node-a": 1, "node-b": 1})
    sup.starter.start_all()
    good = passed_checkpoint(sup, backend, 0)
    custodian = sup.pod.custodian.copies
    record = [r for g, r in custodian.kept if g == 0][-1]
    custodian.push(0, record, "rev-7")
    custodian.push(1, {**record, "sha256": "f" * 64}, "rev-8")    # bytes no entry names
    sup.step()
    entries = read_manifest(sup.pod.pod_dir / sup.pod.plan.config.manifest).entries
    assert entries[0]["hub_revision"] == "rev-7" and not entries.get(1, {}).get("hub_revision")
    (mine,) = events(sup, "sync_pushed", gpu=0)
    assert (mine["node"], mine["revision"], mine["hub_revision_for"]) == ("node-a", "rev-7", [0])
    assert mine["tokens"] == {"0": good["next_token"]}
    assert events(sup, "sync_pushed", gpu=1)[0]["hub_revision_for"] == []


def test_on_a_remote_backend_the_manifest_follows_each_node_push_to_the_hub(make, tmp_path):
    """The nodes push the checkpoints; the launcher pushes the manifest naming them (the
    real local hub store), once per node push, so `launch --from-hub` onto a cluster
    resumes at the pushed tokens, the weights left on the hub."""
    sup, backend, clock = make(stage=1)
    custodian = on_nodes(sup, backend)  # a remote backend: its nodes push the checkpoints
    assert sup.pod.custodian.sync is not None
    sup.starter.start_all()
    store = open_store(sup.pod.plan.config.hub, sup.pod.pod_dir)
    hub_path = sup.pod.plan.config.checkpoint_path(0)
    # The pod's hub as seen from another directory (where `launch --from-hub` rebuilds).
    hub_url = sup.pod.plan.config.hub.replace("file://hub", f"file://{sup.pod.pod_dir / 'hub'}")

    def node_push(event) -> str:
        """What GPU 0's node does with its passed checkpoint (ray.node_checkpoints.NodeCheckpoints.push)."""
        revision = store.push({hub_path: sup.pod.pod_dir / hub_path}, "node push",
                              expected={hub_path: event["sha256"]})
        (record,) = [r for g, r in custodian.kept if g == 0 and r["sha256"] == event["sha256"]]
        custodian.hub[0] = {**record, "path": hub_path, "hub_revision": revision}
        return revision

    def manifest_pushes(count: int) -> list[dict]:
        step_until(sup, lambda: len(events(sup, "sync_pushed", reason="manifest")) >= count,
                   f"manifest push {count}")
        return events(sup, "sync_pushed", reason="manifest")

    for _ in range(5):          # a push started would show as busy before its event
        sup.step()
        assert not sup.pod.custodian.sync.busy
    assert not events(sup, "sync_pushed")          # nothing on the hub yet: nothing pushed
    assert not events(sup, "sync_skipped")         # ...and no event about it on every poll
    first = passed_checkpoint(sup, backend, 0)
    node_push(first)
    (pushed,) = manifest_pushes(1)
    assert pushed["tokens"] == {"0": first["next_token"]} and pushed["hub_revision_for"] == [0]
    for _ in range(5):
        sup.step()                                  # no new node push: no new manifest push
        assert not sup.pod.custodian.sync.busy      # (none started, not just none finished)
    assert len(events(sup, "sync_pushed", reason="manifest")) == 1
    head = store.head()
    assert head == pushed["revision"]
    assert {hub_path, "fractus-pod.yaml", sup.pod.plan.config.manifest} <= set(store.files(head))

    backend.train(0, 50)
    second = backend.checkpoint(0)
    backend.train(0, 60)
    sup.step()
    node_push(second)
    assert manifest_pushes(2)[-1]["tokens"] == {"0": second["next_token"]}

    fresh = tmp_path / "fresh"
    rebuilt = rebuild_from_hub(fresh, hub_url, None, on_cluster=True)
    rev = rebuilt.revision
    rebuilt.take_run()
    rebuilt = read_manifest(fresh / sup.pod.plan.config.manifest)
    assert rebuilt.entries[0]["start_token"] == second["next_token"]
    assert rebuilt.entries[0]["checkpoint_sha256"] == second["sha256"]
    assert rebuilt.entries[0]["hub_revision"] == rev
    assert not (fresh / hub_path).exists()          # the weights stay on the hub

    # The launcher dies between a node's push and the manifest push that follows it: the
    # hub's newest revision is mid-push (its manifest names the previous bytes). A rebuild
    # takes the newest consistent revision, exactly the last manifest push, and says so.
    backend.train(0, 50)
    third = backend.checkpoint(0)
    backend.train(0, 60)
    sup.step()
    mid_push = node_push(third)                     # ...and no supervisor step after it
    newest, before = store.history()[:2]
    assert newest.revision == mid_push
    after_death = tmp_path / "after-death"
    rev = rebuild_from_hub(after_death, hub_url, None, on_cluster=True).revision
    assert rev == before.revision        # the lease the first rebuild took, on the last manifest
    rebuilt = read_manifest(after_death / sup.pod.plan.config.manifest)
    assert rebuilt.entries[0]["start_token"] == second["next_token"]
    (skipped,) = [e for e in read_events(after_death) if e["event"] == "hub_mid_push_skipped"]
    assert skipped["skipped"] == [mid_push] and "gpu_0" in skipped["reason"]
    # Asked for by name, the mid-push revision is refused: nothing is guessed.
    with pytest.raises(IntegrityError, match="other bytes than the revision holds"):
        rebuild_from_hub(tmp_path / "named", hub_url, mid_push, on_cluster=True)
    assert not (tmp_path / "named").exists()


def test_a_node_push_refused_by_a_takeover_stops_every_push_and_is_recorded(make, tmp_path):
    """After `launch --from-hub` took the run over elsewhere, a node's push (as the head's
    pod: launcher/supervise/ray/node_checkpoints.py push_as_pod) is refused; the custodian hears it
    (RayCustodian._harvest_pushes) and records it in the run's one lease, and from then on no
    passed checkpoint is handed to the nodes to push, the launcher's manifest push stops too,
    and events and status say so."""
    sup, backend, clock = make(stage=1)
    custodian = on_nodes(sup, backend)
    sup.starter.start_all()
    pod_dir = sup.pod.pod_dir
    store = open_store(sup.pod.plan.config.hub, pod_dir)
    hub_path = sup.pod.plan.config.checkpoint_path(0)

    def node_push(event) -> str:
        return push_as_pod(store.url, pod_dir, pod_id(pod_dir), hub_path, pod_dir / hub_path,
                           event["sha256"], "node push")

    first = passed_checkpoint(sup, backend, 0)
    revision = node_push(first)
    (record,) = [r for g, r in custodian.kept if g == 0]
    custodian.hub[0] = {**record, "path": hub_path, "hub_revision": revision}
    step_until(sup, lambda: events(sup, "sync_pushed", reason="manifest"), "the manifest push")

    new = tmp_path / "elsewhere"
    new.mkdir()
    lease = take_over(open_store(store.url, new), new)
    taken = store.head()
    backend.train(0, 50)
    second = backend.checkpoint(0)
    backend.train(0, 60)
    sup.step()
    assert len(custodian.kept) == 2                 # this one was handed over, and refused:
    with pytest.raises(RunTakenOver) as refused:
        node_push(second)
    custodian.push_refused(str(refused.value))
    for _ in range(5):
        sup.step()
    (event,) = events(sup, "hub_taken_over")
    assert event["reason"] == "node push" and lease["pod_id"] in event["error"]
    state = read_sync_state(pod_dir)
    assert state["last_result"] == "taken_over" and lease["pod_id"] in state["taken_over"]

    backend.train(0, 50)
    third = backend.checkpoint(0)
    backend.train(0, 60)
    # Another GPU's push that landed before the takeover would change what the manifest
    # names: still, the manifest push does not follow it.
    custodian.hub[0] = {**custodian.kept[1][1], "path": hub_path, "hub_revision": taken}
    for _ in range(5):
        sup.step()
    assert sup.pod.custodian.index.records[(0, third["sha256"])]["verdict"] == PASSED
    assert len(custodian.kept) == 2                  # no further checkpoint goes to a node
    assert len(events(sup, "sync_pushed", reason="manifest")) == 1
    assert store.head() == taken                     # the manifest push stopped too
    assert len(events(sup, "hub_taken_over")) == 1



def test_on_a_remote_backend_a_failed_manifest_push_is_retried_at_the_interval_not_every_poll(
        make, monkeypatch):
    """The hub refuses the manifest push that follows a node's push: one `sync_failed` that
    says when it is retried, not a push (and an event) on every poll of the launcher."""
    sup, backend, clock = make(stage=1)
    custodian = on_nodes(sup, backend)
    sup.starter.start_all()
    hub_path = sup.pod.plan.config.checkpoint_path(0)
    sent = []

    def hub_down(store, snap, message):
        sent.append(message)
        raise ConnectionError("hub unreachable")

    monkeypatch.setattr(snapshot_module, "send", hub_down)    # what every push calls
    first = passed_checkpoint(sup, backend, 0)
    (record,) = [r for g, r in custodian.kept if g == 0 and r["sha256"] == first["sha256"]]
    custodian.hub[0] = {**record, "path": hub_path, "hub_revision": "r1"}
    step_until(sup, lambda: events(sup, "sync_failed"), "the failed manifest push", 30)
    for _ in range(20):                 # no push (thread) started again before the interval
        sup.step()
        assert not sup.pod.custodian.sync.busy
    (failed,) = events(sup, "sync_failed")
    assert failed["reason"] == "manifest" and failed["retry"] == "at the next interval"
    assert "hub unreachable" in failed["error"] and len(sent) == 1
    # A newer node push is a new manifest to name: pushed at once, not at the interval.
    custodian.hub[0] = {**record, "path": hub_path, "hub_revision": "r2", "sha256": "0" * 64}
    step_until(sup, lambda: len(events(sup, "sync_failed")) >= 2, "the second push's failure", 30)
    assert len(sent) == 2
