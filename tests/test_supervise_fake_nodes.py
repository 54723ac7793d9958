"""The supervision state machine on a remote backend (Ray's nodes), driven through a fake
backend: no processes, a fake clock (tests/support/fake_supervisor.py).

Node loss (resume from the hub copy on a free node, waiting visibly until a node joins,
nothing on the hub), a node that stops answering, node pushes noted in the manifest and
followed by the manifest's own push to a real local store, `--from-hub` onto a cluster and
over a mid-push revision, rollback to the launch checkpoint, a takeover stopping every push,
and a bad `ray:` section.
"""

import pytest
import yaml

from launcher.pod.ckpt_index import PASSED
from launcher.pod.manifest import ManifestEntry, read_manifest
from launcher.pod.events import read_events
from launcher.supervise.state import GpuState, PodState
from tests.support.fake_backend import TOKENS_PER_STEP
from tests.support.fake_supervisor import (  # noqa: F401 (fixtures)
    events,
    make,
    on_nodes,
    passed_checkpoint,
    pod_state,
    pod_template,
)


def test_a_lost_node_resumes_its_gpu_on_a_free_node_from_the_hub_copy(make):
    sup, backend, clock = make(nodes={"node-a": 1, "node-b": 2})
    custodian = sup.pod.custodian
    sup.starter.start_all()
    assert [w.node for w in backend.started] == ["node-a", "node-b"]
    on_hub = passed_checkpoint(sup, backend, 0)
    gpu0_passed = [r for g, r in custodian.kept if g == 0]
    assert gpu0_passed and gpu0_passed[-1]["sha256"] == on_hub["sha256"]
    custodian.hub[0] = {**gpu0_passed[-1], "path": "checkpoints/fractus_1b_gpu0.pt",
                      "hub_revision": "rev-1"}
    backend.train(0, 20)
    backend.checkpoint(0)                  # pending, on node-a's disk only
    sup.step()
    backend.lose_node("node-a")
    sup.step()
    run = sup.pod.runs[0]
    assert run.state is GpuState.RUNNING and run.node == "node-b"
    (lost,) = events(sup, "node_lost", gpu=0)
    assert lost["node"] == "node-a"
    (point,) = events(sup, "resume_point", gpu=0)
    assert point["to_token"] == on_hub["next_token"] == 50 * TOKENS_PER_STEP
    assert point["from_token"] == 121 * TOKENS_PER_STEP and point["hub_revision"] == "rev-1"
    spec = backend.current(0).spec
    assert (spec.start_token, spec.ckpt_sha256, spec.ckpt_revision) == \
        (on_hub["next_token"], on_hub["sha256"], "rev-1")
    assert sup.pod.index.pending(0) == []      # the lost node's unjudged checkpoint
    manifest = read_manifest(sup.pod.pod_dir / sup.pod.plan.config.manifest)
    assert manifest.entries[0]["start_token"] == on_hub["next_token"]
    assert manifest.entries[0]["hub_revision"] == "rev-1"
    assert sup.pod.runs[1].state is GpuState.RUNNING and len(backend.started) == 3


def test_a_lost_node_with_no_free_device_waits_visibly_until_a_node_joins(make):
    sup, backend, clock = make(nodes={"node-a": 1, "node-b": 1})
    sup.starter.start_all()
    backend.lose_node("node-a")
    sup.step()
    sup.step()
    assert sup.pod.runs[0].state is GpuState.WAITING
    assert len(events(sup, "gpu_waiting", gpu=0)) == 1          # said once
    assert pod_state(sup)["gpus"]["0"]["state"] == "waiting"
    # Nothing of GPU 0 was ever kept: it starts over from token 0, not from a lost file.
    assert events(sup, "resume_point", gpu=0)[0]["to_token"] == 0
    backend.add_node("node-c", 1)
    sup.step()
    assert sup.pod.runs[0].state is GpuState.RUNNING and sup.pod.runs[0].node == "node-c"
    assert backend.current(0).spec.start_token is None


def test_a_lost_node_whose_checkpoint_the_hub_lacks_fails_that_gpu(make):
    sup, backend, clock = make(stage=1, nodes={"node-a": 1, "node-b": 1})
    sup.pod.launch_entries[0] = ManifestEntry(start_token=640,
                                              checkpoint="checkpoints/x.pt")
    sup.starter.start_all()
    backend.lose_node("node-a")
    sup.step()
    assert sup.pod.state is PodState.FAILED
    assert "hub holds no checkpoint of GPU 0" in events(sup, "pod_failed")[0]["reason"]


def test_a_worker_hung_on_a_node_that_stopped_answering_resumes_on_another(make):
    sup, backend, clock = make(nodes={"node-a": 1, "node-b": 2})
    sup.starter.start_all()
    backend.train(0, 5)
    backend.train(1, 5)
    sup.step()
    backend.silence_node("node-a")
    clock.now += 601
    backend.train(1, 1)
    sup.step()
    run = sup.pod.runs[0]
    assert events(sup, "hang", gpu=0) and events(sup, "node_lost", gpu=0, node="node-a")
    assert not events(sup, "worker_crash") and not run.restarts    # not counted as a crash
    assert run.state is GpuState.RUNNING and run.node == "node-b"


def test_a_node_push_notes_its_hub_revision_where_the_manifest_names_those_bytes(make):
    sup, backend, clock = make(nodes={"node-a": 1, "node-b": 1})
    sup.starter.start_all()
    good = passed_checkpoint(sup, backend, 0)
    custodian = sup.pod.custodian
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


@pytest.mark.parametrize("ray, words", [
    ({"address": "127.0.0.1:6379", "workdir": "/data/pod"}, "ray.workdir must contain {node}"),
    ({"adress": "127.0.0.1:6379"}, "unknown key(s) ['adress']"),
    ({"workdir": "/data/{node}"}, "give the cluster's address"),
    ({"address": "127.0.0.1:6379", "fence_s": 1}, "ray.fence_s must be a number of seconds "
                                                  "from 5 to 3600, got 1"),
    ({"address": "127.0.0.1:6379", "fence_s": ".nan"}, "ray.fence_s must be a number"),
])
def test_a_bad_ray_section_is_refused_in_one_line_before_anything_starts(
        tmp_path, pod_template, capsys, ray, words):
    import shutil

    from launcher.cli import main as cli_main
    pod = tmp_path / "pod"
    shutil.copytree(pod_template, pod)
    config = yaml.safe_load((pod / "fractus-pod.yaml").read_text())
    (pod / "fractus-pod.yaml").write_text(yaml.safe_dump({**config, "ray": ray}))
    assert cli_main(["--pod-dir", str(pod), "launch", "--stage", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err, err
    assert not (pod / "logs" / "events.jsonl").exists()


def test_on_a_remote_backend_the_manifest_follows_each_node_push_to_the_hub(make, tmp_path):
    """The nodes push the checkpoints; the launcher pushes the manifest naming them (the
    real local hub store), once per node push, so `launch --from-hub` onto a cluster
    resumes at the pushed tokens, the weights left on the hub."""
    import time

    from launcher.hub import open_store
    from launcher.hub.from_hub import rebuild_from_hub
    sup, backend, clock = make(stage=1)
    custodian = on_nodes(sup, backend)  # a remote backend: its nodes push the checkpoints
    assert sup.sync is not None
    sup.starter.start_all()
    store = open_store(sup.pod.plan.config.hub, sup.pod.pod_dir)
    hub_path = sup.pod.plan.config.checkpoint_path(0)

    def node_push(event) -> str:
        """What GPU 0's node does with its passed checkpoint (ray_node.NodeWorker.push)."""
        revision = store.push({hub_path: sup.pod.pod_dir / hub_path}, "node push",
                              expected={hub_path: event["sha256"]})
        (record,) = [r for g, r in custodian.kept if g == 0 and r["sha256"] == event["sha256"]]
        custodian.hub[0] = {**record, "path": hub_path, "hub_revision": revision}
        return revision

    def manifest_pushes(count: int) -> list[dict]:
        deadline = time.monotonic() + 60
        while len(events(sup, "sync_pushed", reason="manifest")) < count \
                and time.monotonic() < deadline:
            sup.step()
            time.sleep(0.05)
        return events(sup, "sync_pushed", reason="manifest")

    for _ in range(5):
        sup.step()
    assert not events(sup, "sync_pushed")          # nothing on the hub yet: nothing pushed
    assert not events(sup, "sync_skipped")         # ...and no event about it on every poll
    first = passed_checkpoint(sup, backend, 0)
    node_push(first)
    (pushed,) = manifest_pushes(1)
    assert pushed["tokens"] == {"0": first["next_token"]} and pushed["hub_revision_for"] == [0]
    for _ in range(5):
        sup.step()                                  # no new node push: no new manifest push
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
    rev, _config, _lease = rebuild_from_hub(fresh, sup.pod.plan.config.hub.replace(
        "file://hub", f"file://{sup.pod.pod_dir / 'hub'}"), None, on_cluster=True)
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
    rev, _config, _lease = rebuild_from_hub(after_death, sup.pod.plan.config.hub.replace(
        "file://hub", f"file://{sup.pod.pod_dir / 'hub'}"), None, on_cluster=True)
    assert rev == before.revision        # the lease the first rebuild took, on the last manifest
    rebuilt = read_manifest(after_death / sup.pod.plan.config.manifest)
    assert rebuilt.entries[0]["start_token"] == second["next_token"]
    (skipped,) = [e for e in read_events(after_death) if e["event"] == "hub_mid_push_skipped"]
    assert skipped["skipped"] == [mid_push] and "gpu_0" in skipped["reason"]
    # Asked for by name, the mid-push revision is refused: nothing is guessed.
    from launcher.hub import IntegrityError
    with pytest.raises(IntegrityError, match="other bytes than the revision holds"):
        rebuild_from_hub(tmp_path / "named", sup.pod.plan.config.hub.replace(
            "file://hub", f"file://{sup.pod.pod_dir / 'hub'}"), mid_push, on_cluster=True)
    assert not (tmp_path / "named").exists()


def test_on_a_remote_backend_a_rollback_with_nothing_newer_passed_restores_the_launch_checkpoint(
        make):
    """Launched with --from-hub onto a cluster: the checkpoint each GPU resumed from is on
    the hub (each node pulled its own), never on the head. A GPU failing before any newer
    checkpoint passed rolls back to exactly that one, as on one machine."""
    from launcher.pod.manifest import ManifestEntry
    sup, backend, clock = make(stage=3, on_nodes=True)      # the nodes hold the files
    launch = ManifestEntry(start_token=64 * TOKENS_PER_STEP,
                           checkpoint="checkpoints/fractus_1b_gpu0.pt",
                           checkpoint_sha256="ab" * 32, hub_revision="f" * 40, stage=3,
                           ema_tf=5.0, lb=2.0)
    sup.pod.manifest.entries[0] = launch.copy()
    sup.pod.launch_entries[0] = launch.copy()
    sup.starter.start_all()
    assert backend.current(0).spec.start_token == launch.start_token
    backend.train(0, 5)
    backend.checkpoint(0)                           # pending: never vouched for
    backend.event(0, "nan", step=70)
    sup.step()
    (rollback,) = events(sup, "rollback", gpu=0)
    assert (rollback["to_token"], rollback["to_stage"]) == (launch.start_token, 2)
    assert sup.pod.state is PodState.RUNNING and sup.pod.stage == 2
    entry = read_manifest(sup.pod.pod_dir / sup.pod.plan.config.manifest).entries[0]
    assert (entry.start_token, entry.checkpoint_sha256, entry.hub_revision) == (
        launch.start_token, launch.checkpoint_sha256, launch.hub_revision)
    restarted = backend.current(0).spec
    assert (restarted.start_token, restarted.ckpt_revision) == (launch.start_token,
                                                                launch.hub_revision)


def test_a_node_push_refused_by_a_takeover_stops_every_push_and_is_recorded(make, tmp_path):
    """After `launch --from-hub` took the run over elsewhere, a node's push (as the head's
    pod: launcher/supervise/ray_node.py push_as_pod) is refused; the custodian hears it
    (RayCustodian._harvest_pushes) and records it in the run's one lease, and from then on no passed checkpoint is handed to the
    nodes to push, the launcher's manifest push stops too, and events and status say so."""
    import time

    from launcher.hub import open_store
    from launcher.hub.lease import RunTakenOver, pod_id, take_over
    from launcher.hub.sync import read_sync_state
    from launcher.supervise.ray_node import push_as_pod
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
    deadline = time.monotonic() + 60
    while not events(sup, "sync_pushed", reason="manifest") and time.monotonic() < deadline:
        sup.step()
        time.sleep(0.05)
    assert events(sup, "sync_pushed", reason="manifest")

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
    assert sup.pod.index.records[(0, third["sha256"])]["verdict"] == PASSED
    assert len(custodian.kept) == 2                  # no further checkpoint goes to a node
    assert len(events(sup, "sync_pushed", reason="manifest")) == 1
    assert store.head() == taken                     # the manifest push stopped too
    assert len(events(sup, "hub_taken_over")) == 1



def test_on_a_remote_backend_a_failed_manifest_push_is_retried_at_the_interval_not_every_poll(
        make, monkeypatch):
    """The hub refuses the manifest push that follows a node's push: one `sync_failed` that
    says when it is retried, not a push (and an event) on every poll of the launcher."""
    import time

    import launcher.hub.snapshot as snapshot_module
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
    deadline = time.monotonic() + 30
    while not events(sup, "sync_failed") and time.monotonic() < deadline:
        sup.step()
        time.sleep(0.05)
    for _ in range(20):                 # no push (thread) started again before the interval
        sup.step()
        assert not sup.sync.busy
    (failed,) = events(sup, "sync_failed")
    assert failed["reason"] == "manifest" and failed["retry"] == "at the next interval"
    assert "hub unreachable" in failed["error"] and len(sent) == 1
    # A newer node push is a new manifest to name: pushed at once, not at the interval.
    custodian.hub[0] = {**record, "path": hub_path, "hub_revision": "r2", "sha256": "0" * 64}
    deadline = time.monotonic() + 30
    while len(events(sup, "sync_failed")) < 2 and time.monotonic() < deadline:
        sup.step()
        time.sleep(0.05)
    assert len(sent) == 2


def test_on_a_remote_backend_a_checkpoint_its_node_could_not_retain_is_never_probed(make):
    """A node read the event after its worker had rotated those bytes away (its poll
    stalled): it says so (`retained: false`, launcher/supervise/ray_node.py) and the head
    asks no probe of it, which would only come back "not retained" without a verdict (CI
    saw that as the first probe of a GPU); the next checkpoint, retained, is probed."""
    from tests.support.fake_supervisor import ProbeRecorder
    sup, backend, clock = make(nodes={"node-a": 1, "node-b": 1}, on_nodes=True)  # node files
    sup.starter.start_all()
    probes = sup.pod.probes = ProbeRecorder()
    backend.train(0, 10)
    lost = backend.checkpoint_line(0, retained=False)
    backend.train(0, 10)
    kept = backend.checkpoint_line(0, retained=True)
    sup.step()
    assert [sha for _, _, sha in probes.requests] == [kept["sha256"]]
    assert lost["sha256"] in {sha for (_g, sha) in sup.pod.index.records}


def test_status_of_a_ray_pod_shows_what_a_waiting_gpu_resumes_from(make):
    """`status` on a Ray pod (issue 16 item 33): checkpoints live on the nodes, so none is
    'missing' from the head; the checkpoint age comes from the nodes' checkpoint events; a
    GPU waiting for a node shows no node, no pid and none of its lost worker's numbers, but
    the point it resumes from."""
    from launcher.dashboard.status import collect
    from launcher.pod.lock import PodLock
    # As on Ray: the checkpoints are on the nodes.
    sup, backend, clock = make(nodes={"node-a": 1, "node-b": 1}, on_nodes=True)
    sup.starter.start_all()
    on_hub = passed_checkpoint(sup, backend, 0)
    sup.pod.custodian.hub[0] = {**on_hub, "path": "checkpoints/fractus_1b_gpu0.pt",
                      "hub_revision": "rev-1"}
    backend.train(0, 20)
    for gpu in (0, 1):            # on the nodes' disks only
        (sup.pod.pod_dir / "checkpoints" / f"fractus_1b_gpu{gpu}.pt").unlink(missing_ok=True)
    backend.checkpoint_line(1, retained=True)
    sup.step()
    with PodLock(sup.pod.pod_dir):           # as a running launcher holds it
        pod_state(sup)
        rows = collect(sup.pod.pod_dir, sup.pod.plan.config)["gpus"]
        assert [r["checkpoint_problem"] for r in rows] == [None, None]
        assert rows[1]["checkpoint_age_s"] is not None
        assert rows[0]["node"] == "node-a"

        backend.lose_node("node-a")
        sup.step()
        assert sup.pod.runs[0].state is GpuState.WAITING
        pod_state(sup)
        waiting = collect(sup.pod.pod_dir, sup.pod.plan.config)["gpus"][0]
    assert waiting["state"] == "waiting"
    assert waiting["node"] is None and waiting["pid"] is None
    assert waiting["next_token"] == on_hub["next_token"] and waiting["tok_s"] is None
    assert waiting["checkpoint_problem"] is None
    assert waiting["checkpoint_age_s"] is not None       # the hub copy it resumes from
