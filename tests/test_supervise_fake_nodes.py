"""The supervision state machine on a remote backend (Ray's nodes), driven through a fake
backend: no processes, a fake clock (tests/support/fake_supervisor.py).

Node loss (resume from the hub copy on a free node, waiting visibly until a node joins,
nothing on the hub), a node that stops answering, rollback to the launch checkpoint, no probe
of a checkpoint its node could not retain, `status` of a GPU waiting for a node, and a bad
`ray:` section. The hub pushes of the nodes and the manifest's after them:
test_supervise_fake_node_pushes.py.
"""


import shutil

import pytest
import yaml

from launcher.cli import main as cli_main
from launcher.dashboard.status import collect
from launcher.pod.lock import PodLock
from launcher.pod.manifest import ManifestEntry, read_manifest
from launcher.supervise.backend import WorkerExit
from launcher.supervise.state import GpuState, PodState
from tests.support.fake_backend import TOKENS_PER_STEP
from tests.support.fake_supervisor import (  # noqa: F401 (fixtures)
    ProbeRecorder,
    events,
    make,
    passed_checkpoint,
    pod_state,
    pod_template,
)


def test_a_lost_node_resumes_its_gpu_on_a_free_node_from_the_hub_copy(make):
    sup, backend, clock = make(nodes={"node-a": 1, "node-b": 2})
    custodian = sup.pod.custodian.copies
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
    assert sup.pod.custodian.index.pending(0) == []      # the lost node's unjudged checkpoint
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
    sup.pod.custodian.launch_entries[0] = ManifestEntry(start_token=640,
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



def test_a_gpu_whose_actor_the_backend_is_replacing_is_not_killed_as_hung(make):
    """Its node's actor died and a new one adopts the GPU once the old worker's final save
    ended (RayBackend: by a deadline of its own): the GPU is silent meanwhile, and that is
    no hang. Under load an adoption outlasted the hang limit, and the GPU restarted as hung
    instead of as the actor's death (the Ray test, CI load)."""
    sup, backend, clock = make()
    sup.starter.start_all()
    backend.train(0, 5)
    backend.train(1, 5)
    sup.step()
    backend.adopting.add(0)
    clock.now += 700                       # past the 600 s limit
    backend.train(1, 1)
    sup.step()
    assert not events(sup, "hang") and sup.pod.runs[0].state is GpuState.RUNNING
    error = "its actor's process died on node node-a, which is alive; the final save ended"
    backend._end(backend.started[0], WorkerExit(-15, error=error))     # adopted
    sup.step()
    (crash,) = events(sup, "worker_crash", gpu=0)
    assert crash["reason"] == error and not events(sup, "hang")


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
    pod = tmp_path / "pod"
    shutil.copytree(pod_template, pod)
    config = yaml.safe_load((pod / "fractus-pod.yaml").read_text())
    (pod / "fractus-pod.yaml").write_text(yaml.safe_dump({**config, "ray": ray}))
    assert cli_main(["--pod-dir", str(pod), "launch", "--stage", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err, err
    assert not (pod / "logs" / "events.jsonl").exists()


def test_on_a_remote_backend_a_rollback_with_nothing_newer_passed_restores_the_launch_checkpoint(
        make):
    """Launched with --from-hub onto a cluster: the checkpoint each GPU resumed from is on
    the hub (each node pulled its own), never on the head. A GPU failing before any newer
    checkpoint passed rolls back to exactly that one, as on one machine."""
    sup, backend, clock = make(stage=3, on_nodes=True)      # the nodes hold the files
    launch = ManifestEntry(start_token=64 * TOKENS_PER_STEP,
                           checkpoint="checkpoints/fractus_1b_gpu0.pt",
                           checkpoint_sha256="ab" * 32, hub_revision="f" * 40, stage=3,
                           ema_tf=5.0, lb=2.0)
    sup.pod.manifest.entries[0] = launch.copy()
    sup.pod.custodian.launch_entries[0] = launch.copy()
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



def test_on_a_remote_backend_a_checkpoint_its_node_could_not_retain_is_never_probed(make):
    """A node read the event after its worker had rotated those bytes away (its poll
    stalled): it says so (`retained: false`, launcher/supervise/ray/node.py) and the head
    asks no probe of it, which would only come back "not retained" without a verdict (CI
    saw that as the first probe of a GPU); the next checkpoint, retained, is probed."""
    sup, backend, clock = make(nodes={"node-a": 1, "node-b": 1}, on_nodes=True)  # node files
    sup.starter.start_all()
    probes = sup.pod.probes = ProbeRecorder()
    backend.train(0, 10)
    lost = backend.checkpoint_line(0, retained=False)
    backend.train(0, 10)
    kept = backend.checkpoint_line(0, retained=True)
    sup.step()
    assert [sha for _, _, sha in probes.requests] == [kept["sha256"]]
    assert lost["sha256"] in {sha for (_g, sha) in sup.pod.custodian.index.records}


def test_status_of_a_ray_pod_shows_what_a_waiting_gpu_resumes_from(make):
    """`status` on a Ray pod (issue 16 item 33): checkpoints live on the nodes, so none is
    'missing' from the head; the checkpoint age comes from the nodes' checkpoint events; a
    GPU waiting for a node shows no node, no pid and none of its lost worker's numbers, but
    the point it resumes from."""
    # As on Ray: the checkpoints are on the nodes.
    sup, backend, clock = make(nodes={"node-a": 1, "node-b": 1}, on_nodes=True)
    sup.starter.start_all()
    on_hub = passed_checkpoint(sup, backend, 0)
    sup.pod.custodian.copies.hub[0] = {**on_hub, "path": "checkpoints/fractus_1b_gpu0.pt",
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
