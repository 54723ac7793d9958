"""The supervision state machine driven through a fake backend: no processes, a fake clock.

Every transition of a GPU and of the pod (start, crash and restart, the restart budget,
hang, NaN, refused settings, rollback, stop, --max-time, the canary gate, node loss with
its resume from the hub, waiting for a node, done) is exercised through the real
Supervisor, health checks, checkpoint index, manifest and event log.
"""

import hashlib
import signal

import pytest
import yaml

from launcher.pod.ckpt_index import FAILED, PASSED, CheckpointIndex
from launcher.pod.events import EventLog, read_events
from launcher.pod.manifest import ManifestEntry, read_manifest
from launcher.config.podconfig import init_pod
from launcher.supervise.prepare import load_plan
from launcher.pod.live_state import read_pod_state
from launcher.supervise.state import (
    GpuEvent,
    GpuState,
    IllegalTransition,
    PodEvent,
    PodState,
    exit_event,
    transition,
)
from launcher.supervise.supervisor import Supervisor
from tests.support.fake_backend import TOKENS_PER_STEP, FakeBackend


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def pod_template(tmp_path_factory):
    pod = tmp_path_factory.mktemp("template") / "pod"
    init_pod(pod, "tiny-cpu")
    criteria = pod / "manifests" / "trusted_loss.yaml"
    doc = yaml.safe_load(criteria.read_text())
    doc["probe"]["every"] = 0            # no probe processes: this module starts none
    criteria.write_text(yaml.safe_dump(doc))
    return pod


@pytest.fixture
def make(tmp_path, pod_template):
    import shutil

    def build(stage=3, nodes=None, max_time=None):
        pod = tmp_path / "pod"
        if not pod.exists():
            shutil.copytree(pod_template, pod)
        plan, manifest = load_plan(pod, stage, "cpu:2", None, max_time=max_time)
        backend, clock = FakeBackend(pod, nodes), Clock()
        sup = Supervisor(plan, manifest, CheckpointIndex(pod), EventLog(pod), backend=backend,
                         clock=clock)
        return sup, backend, clock
    return build


def events(sup, name, **match):
    return [e for e in read_events(sup.pod.pod_dir) if e["event"] == name
            and all(e.get(k) == v for k, v in match.items())]


def pod_state(sup) -> dict:
    """logs/pod_state.json as `status` reads it (written now: the loop throttles writes)."""
    sup.view.write(force=True)
    return read_pod_state(sup.pod.pod_dir)


def passed_checkpoint(sup, backend, gpu) -> dict:
    """Train GPU `gpu` to a checkpoint at step 50 and on to step 101, where the periodic
    checks (every 100 steps from the first line) vouch for it."""
    backend.train(gpu, 50)
    event = backend.checkpoint(gpu)
    backend.train(gpu, 51)
    sup.step()
    record = sup.pod.index.records[(gpu, event["sha256"])]
    assert record["verdict"] == PASSED
    return event


def test_the_transition_table_refuses_what_it_does_not_list():
    assert transition(GpuState.PENDING, GpuEvent.STARTED) is GpuState.RUNNING
    assert transition(GpuState.RUNNING, GpuEvent.NODE_LOST) is GpuState.WAITING
    assert transition(PodState.RUNNING, PodEvent.ROLLBACK) is PodState.ROLLING_BACK
    with pytest.raises(IllegalTransition, match="RUNNING has no transition on GpuEvent.STARTED"):
        transition(GpuState.RUNNING, GpuEvent.STARTED)
    with pytest.raises(IllegalTransition):
        transition(GpuState.DONE, GpuEvent.CRASHED)
    with pytest.raises(IllegalTransition):
        transition(PodState.FAILED, PodEvent.STARTED)
    assert [exit_event(c, True) for c in (0, 1, 2, 3, 4, 5, -9)] == [
        GpuEvent.FINISHED, GpuEvent.CRASHED, GpuEvent.REFUSED, GpuEvent.CHECK_EXIT,
        GpuEvent.CHECK_EXIT, GpuEvent.DISK_FULL, GpuEvent.CRASHED]
    assert exit_event(1, pod_running=False) is GpuEvent.STOPPED
    assert str(GpuState.WAITING) == "waiting" and f"{PodState.CANARY}" == "canary"


def test_start_then_every_worker_done_is_a_done_pod(make):
    sup, backend, clock = make()
    sup.starter.start_all()
    assert sup.pod.state is PodState.RUNNING
    assert {g: r.state for g, r in sup.pod.runs.items()} == {0: "running", 1: "running"}
    assert [e["gpu"] for e in events(sup, "worker_start")] == [0, 1]
    backend.exit(0, 0)
    sup.step()
    assert sup.pod.runs[0].state is GpuState.DONE and sup.pod.state is PodState.RUNNING
    backend.exit(1, 0)
    sup.step()
    assert sup.pod.state is PodState.DONE and events(sup, "pod_done")
    state = pod_state(sup)
    assert state["gpus"]["0"]["state"] == "done" and state["gpus"]["0"]["node"] == "node-a"


def test_a_crash_backs_off_then_restarts_from_the_last_checkpoint(make):
    sup, backend, clock = make()
    sup.starter.start_all()
    backend.train(0, 10)
    ckpt = backend.checkpoint(0)
    backend.exit(0, 1)
    sup.step()
    run = sup.pod.runs[0]
    assert run.state is GpuState.BACKOFF and run.exit_code == 1
    (crash,) = events(sup, "worker_crash", gpu=0)
    assert crash["restart_in_s"] == 2.0 and crash["reason"] == "exit code 1"
    clock.now += 1.9
    sup.step()
    assert run.state is GpuState.BACKOFF            # not before its backoff
    clock.now += 0.2
    sup.step()
    assert run.state is GpuState.RUNNING
    assert backend.current(0).spec.start_token == ckpt["next_token"] == 10 * TOKENS_PER_STEP
    assert len(events(sup, "worker_start", gpu=0)) == 2


def test_a_call_that_failed_on_the_node_is_a_crash_whose_error_is_in_the_events(make):
    """A Ray call that raised on the node (RayTaskError out of NodeWorker.poll) ends the
    GPU as a crashed worker: the error in the events, then the restart policy."""
    sup, backend, clock = make()
    sup.starter.start_all()
    error = "RayTaskError(FileNotFoundError: [Errno 2] No such file: 'x.pt')"
    backend.exit(0, -9, error=error)
    sup.step()
    run = sup.pod.runs[0]
    assert run.state is GpuState.BACKOFF and sup.pod.state is PodState.RUNNING
    (ended,) = events(sup, "worker_exit", gpu=0)
    assert ended["error"] == error and ended["code"] == -9
    (crash,) = events(sup, "worker_crash", gpu=0)
    assert crash["reason"] == error
    clock.now += crash["restart_in_s"] + 0.1
    sup.step()
    assert run.state is GpuState.RUNNING and len(events(sup, "worker_start", gpu=0)) == 2


def test_crashes_past_the_budget_fail_the_gpu_and_at_stage_1_the_pod(make):
    sup, backend, clock = make(stage=1)
    sup.starter.start_all()
    for _ in range(4):                   # max_restarts: 3
        backend.exit(0, 1)
        sup.step()
        clock.now += 120
        sup.step()
    assert sup.pod.runs[0].state is GpuState.STOPPED    # failed, then stopped with the pod
    assert sup.pod.state is PodState.FAILED and sup.pod.exit_code == 1
    (failed,) = events(sup, "pod_failed")
    assert "4 crashes within 900s" in failed["reason"]
    assert backend.current(1).signals == [signal.SIGTERM]   # the healthy GPU saved


def test_a_silent_worker_is_killed_as_hung_and_restarted(make):
    sup, backend, clock = make()
    sup.starter.start_all()
    backend.train(0, 5)
    backend.train(1, 5)
    sup.step()
    clock.now += 599
    backend.train(1, 1)          # GPU 1 keeps talking
    sup.step()
    assert sup.pod.runs[0].state is GpuState.RUNNING
    clock.now += 2
    sup.step()
    hung = backend.started[0]
    assert hung.signals == [signal.SIGKILL] and sup.pod.runs[0].state is GpuState.BACKOFF
    (hang,) = events(sup, "hang", gpu=0)
    assert hang["limit_s"] == 600 and hang["pid"] == hung.pid
    assert sup.pod.runs[1].state is GpuState.RUNNING


@pytest.mark.parametrize("stage, code, pod_exit, words", [
    (3, 2, 2, "refused its settings"),        # bad settings: restarting cannot fix it
    (1, 3, 1, "NaN"),                         # a NaN exit at stage 1: nothing to roll back to
    (3, 5, 1, "disk full"),
])
def test_exits_that_fail_the_pod(make, stage, code, pod_exit, words):
    sup, backend, clock = make(stage=stage)
    sup.starter.start_all()
    backend.exit(1, code)
    sup.step()
    assert sup.pod.runs[1].state is GpuState.STOPPED and sup.pod.state is PodState.FAILED
    assert sup.pod.exit_code == pod_exit
    assert words in events(sup, "pod_failed")[0]["reason"]


def test_nan_rolls_the_gpu_back_to_its_passed_checkpoint_and_the_pod_down_a_stage(make):
    sup, backend, clock = make(stage=3)
    sup.starter.start_all()
    good = passed_checkpoint(sup, backend, 0)
    backend.train(0, 10)
    backend.checkpoint(0)                 # pending: never vouched for
    backend.train(1, 30)
    backend.event(0, "nan", step=112)
    sup.step()
    assert events(sup, "check_failed", gpu=0)
    (rollback,) = events(sup, "rollback", gpu=0)
    assert rollback["to_token"] == good["next_token"] and rollback["to_stage"] == 2
    first_0, first_1 = backend.started[0], backend.started[1]
    assert first_0.signals == [signal.SIGKILL] and first_1.signals == [signal.SIGTERM]
    assert sup.pod.stage == 2 and sup.pod.state is PodState.RUNNING and sup.pod.rolled_back
    manifest = read_manifest(sup.pod.pod_dir / sup.pod.plan.config.manifest)
    assert manifest.entries[0]["start_token"] == good["next_token"]
    assert manifest.entries[0]["stage"] == 2
    assert manifest.entries[1]["start_token"] == 30 * TOKENS_PER_STEP    # kept its progress
    assert [r["verdict"] for r in sup.pod.index.for_gpu(0)] == [PASSED, FAILED]
    assert backend.current(0).spec.start_token == good["next_token"]
    assert backend.current(0).spec.stage == 2 and len(backend.started) == 4

    backend.event(0, "nan", step=200)          # a second failure: no loop
    sup.step()
    assert sup.pod.state is PodState.FAILED and sup.pod.exit_code == 1
    assert "failed after a rollback" in events(sup, "pod_failed")[0]["reason"]


def test_stop_checkpoints_every_worker_and_records_where_each_resumes(make):
    sup, backend, clock = make()
    sup.starter.start_all()
    backend.train(0, 7)
    backend.train(1, 9)
    sup.stop_reason = "SIGTERM received"
    sup.step()
    assert sup.pod.state is PodState.STOPPED
    assert all(w.signals == [signal.SIGTERM] for w in backend.started)
    assert {r.state for r in sup.pod.runs.values()} == {GpuState.STOPPED}
    manifest = read_manifest(sup.pod.pod_dir / sup.pod.plan.config.manifest)
    assert manifest.entries[0]["start_token"] == 7 * TOKENS_PER_STEP
    assert manifest.entries[1]["start_token"] == 9 * TOKENS_PER_STEP
    assert [e["code"] for e in events(sup, "worker_exit")] == [0, 0]


def test_max_time_stops_the_pod(make):
    sup, backend, clock = make(max_time=60)
    sup.starter.start_all()
    deadline = clock.now + sup.pod.plan.max_time
    sup.step(deadline)
    assert sup.pod.state is PodState.RUNNING
    clock.now += 61
    sup.step(deadline)
    assert sup.pod.state is PodState.STOPPED
    assert "--max-time" in events(sup, "pod_stopped")[0]["reason"]


def test_the_canary_gate_passes_or_refuses_before_anything_starts(make):
    sup, backend, clock = make()
    seen = []
    sup.gate(lambda: seen.append(read_pod_state(sup.pod.pod_dir)["pod_state"]))
    assert seen == ["canary"] and sup.pod.state is PodState.STARTING

    sup, backend, clock = make()

    def refuse():
        raise RuntimeError("canary FAILED: stage 3 does not continue stage 2's curve")
    with pytest.raises(RuntimeError):
        sup.gate(refuse)
    assert sup.pod.state is PodState.STOPPED and not backend.started
    state = read_pod_state(sup.pod.pod_dir)
    assert state["pod_state"] == "stopped" and "canary FAILED" in state["reason"]


def test_a_lost_node_resumes_its_gpu_on_a_free_node_from_the_hub_copy(make):
    sup, backend, clock = make(nodes={"node-a": 1, "node-b": 2})
    sup.starter.start_all()
    assert [w.node for w in backend.started] == ["node-a", "node-b"]
    on_hub = passed_checkpoint(sup, backend, 0)
    gpu0_passed = [r for g, r in backend.passed if g == 0]
    assert gpu0_passed and gpu0_passed[-1]["sha256"] == on_hub["sha256"]
    backend.hub[0] = {**gpu0_passed[-1], "path": "checkpoints/fractus_1b_gpu0.pt",
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


def test_an_oom_exit_fails_the_check_and_rolls_the_gpu_back(make):
    sup, backend, clock = make(stage=3)
    sup.starter.start_all()
    good = passed_checkpoint(sup, backend, 0)
    backend.train(1, 101)
    backend.exit(0, 4)
    sup.step()
    (failed,) = events(sup, "check_failed", gpu=0)
    assert "worker exited 4 (out of memory)" in failed["reason"]
    (rollback,) = events(sup, "rollback", gpu=0)
    assert rollback["to_token"] == good["next_token"] and sup.pod.stage == 2


def test_the_monitor_turns_a_workers_lines_into_records(make):
    sup, backend, clock = make()
    sup.starter.start_all()
    early = backend.checkpoint(0, ema_tf=None)       # stopped before its first step
    backend.event(1, "error", message="E" * 400)
    sup.step()
    record = sup.pod.index.records[(0, early["sha256"])]
    assert (record["verdict"], record["reason"]) == (FAILED, "no training step behind it")
    assert pod_state(sup)["gpus"]["1"]["last_error"] == "E" * 300
    backend.train(0, 10)
    backend.checkpoint(0)
    sup.step()
    manifest_path = sup.pod.pod_dir / sup.pod.plan.config.manifest
    assert read_manifest(manifest_path).entries[0]["start_token"] == 10 * TOKENS_PER_STEP
    backend.current(0).next_token -= 5 * TOKENS_PER_STEP      # a checkpoint from behind
    backend.checkpoint(0)
    sup.step()
    (refused,) = events(sup, "manifest_refused", gpu=0)
    assert "behind the manifest" in refused["reason"]
    assert read_manifest(manifest_path).entries[0]["start_token"] == 10 * TOKENS_PER_STEP


def test_a_checkpoint_written_after_its_gpu_failed_is_failed(make):
    sup, backend, clock = make(stage=1)
    sup.starter.start_all()
    backend.train(0, 5)
    backend.event(0, "nan", step=5)
    after = backend.checkpoint(0)
    sup.step()
    record = sup.pod.index.records[(0, after["sha256"])]
    assert (record["verdict"], record["reason"]) == (FAILED, "written after its GPU failed")
    assert sup.pod.state is PodState.FAILED


def test_a_node_push_notes_its_hub_revision_where_the_manifest_names_those_bytes(make):
    sup, backend, clock = make(nodes={"node-a": 1, "node-b": 1})
    sup.starter.start_all()
    good = passed_checkpoint(sup, backend, 0)
    record = [r for g, r in backend.passed if g == 0][-1]
    backend.push(0, record, "rev-7")
    backend.push(1, {**record, "sha256": "f" * 64}, "rev-8")    # bytes no entry names
    sup.step()
    entries = read_manifest(sup.pod.pod_dir / sup.pod.plan.config.manifest).entries
    assert entries[0]["hub_revision"] == "rev-7" and not entries.get(1, {}).get("hub_revision")
    (mine,) = events(sup, "sync_pushed", gpu=0)
    assert (mine["node"], mine["revision"], mine["hub_revision_for"]) == ("node-a", "rev-7", [0])
    assert mine["tokens"] == {"0": good["next_token"]}
    assert events(sup, "sync_pushed", gpu=1)[0]["hub_revision_for"] == []


def test_a_rollback_asked_by_hand_goes_down_only(make):
    from launcher.pod.live_state import write_rollback_request
    sup, backend, clock = make(stage=3)
    sup.starter.start_all()
    good = passed_checkpoint(sup, backend, 0)
    write_rollback_request(sup.pod.pod_dir, 4, [0])
    sup.step()
    assert events(sup, "rollback_refused", to_stage=4) and sup.pod.stage == 3
    backend.train(0, 5)
    write_rollback_request(sup.pod.pod_dir, 1, [0])
    sup.step()
    (rollback,) = events(sup, "rollback", gpu=0)
    assert (rollback["automatic"], rollback["to_stage"]) == (False, 1)
    assert rollback["to_token"] == good["next_token"]
    assert sup.pod.stage == 1 and sup.pod.state is PodState.RUNNING
    assert not sup.pod.rolled_back          # a rollback by hand leaves the automatic one


def test_a_failed_gpu_with_no_passed_checkpoint_fails_the_pod(make):
    sup, backend, clock = make(stage=3)
    sup.starter.start_all()
    backend.train(0, 5)
    backend.event(0, "nan", step=5)
    sup.step()
    assert sup.pod.state is PodState.FAILED and sup.pod.exit_code == 1
    assert "GPU 0 failed and has no passed checkpoint to restore" in \
        events(sup, "pod_failed")[0]["reason"]


def test_a_clean_stop_judges_each_gpus_last_checkpoint(make):
    sup, backend, clock = make()
    sup.starter.start_all()
    backend.train(0, 101)
    backend.train(1, 101)
    sup.step()
    backend.train(0, 30)
    backend.train(1, 30)
    sup.stop_reason = "SIGTERM received"
    sup.step()                             # SIGTERM: each worker checkpoints at step 131
    assert sup.pod.state is PodState.STOPPED
    last = {g: sup.pod.index.pending(g)[-1] for g in (0, 1)}
    assert {r["step"] for r in last.values()} == {131}
    sup.final.judge()
    (final,) = events(sup, "final_verdicts")
    assert {g: v["verdict"] for g, v in final["verdicts"].items()} == {"0": PASSED, "1": PASSED}
    assert [sup.pod.index.records[(g, r["sha256"])]["verdict"] for g, r in last.items()] \
        == [PASSED, PASSED]


@pytest.mark.parametrize("ray, words", [
    ({"address": "127.0.0.1:6379", "workdir": "/data/pod"}, "ray.workdir must contain {node}"),
    ({"adress": "127.0.0.1:6379"}, "unknown key(s) ['adress']"),
    ({"workdir": "/data/{node}"}, "give the cluster's address"),
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
    sup.use_backend(backend)            # a remote backend: its nodes push the checkpoints
    assert sup.sync is not None
    sup.starter.start_all()
    store = open_store(sup.pod.plan.config.hub, sup.pod.pod_dir)
    hub_path = sup.pod.plan.config.checkpoint_path(0)

    def node_push(event) -> str:
        """What GPU 0's node does with its passed checkpoint (ray_node.NodeWorker.push)."""
        revision = store.push({hub_path: sup.pod.pod_dir / hub_path}, "node push",
                              expected={hub_path: event["sha256"]})
        (record,) = [r for g, r in backend.passed if g == 0 and r["sha256"] == event["sha256"]]
        backend.hub[0] = {**record, "path": hub_path, "hub_revision": revision}
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


class ProbeRecorder:
    """Stands in for the ProbeMonitor: records what would be probed, judges nothing."""

    def __init__(self):
        self.requests = []

    def on_checkpoint(self, gpu, checkpoint, shard, sha256, step):
        self.requests.append((gpu, checkpoint, sha256))

    def vouched_step(self, gpu):
        return None

    def poll(self):
        return []

    def busy(self):
        return False


def test_a_checkpoint_rotated_away_before_its_event_was_read_is_never_probed_under_its_name(make):
    """Under load the launcher reads a checkpoint event after the worker saved again past
    SAVE_KEEP: the worker's own name then holds newer bytes. Probing that name would judge
    the newer checkpoint under the older one's sha256; only pinned bytes are probed."""
    sup, backend, clock = make()
    sup.starter.start_all()
    probes = sup.pod.probes = ProbeRecorder()
    backend.train(0, 10)
    older = backend.checkpoint(0)              # its bytes are gone before the poll...
    backend.train(0, 10)
    newer = backend.checkpoint(0)              # ...replaced under the same name
    sup.step()
    assert [sha for _, _, sha in probes.requests] == [newer["sha256"]]
    (_, name, _), = probes.requests
    record = sup.pod.index.records[(0, newer["sha256"])]
    assert name == record["retained"]          # the pinned link, not the worker's name
    assert hashlib.sha256((sup.pod.pod_dir / name).read_bytes()).hexdigest() == newer["sha256"]
    assert sup.pod.index.records[(0, older["sha256"])]["retained"] is None


def test_on_a_remote_backend_a_rollback_with_nothing_newer_passed_restores_the_launch_checkpoint(
        make):
    """Launched with --from-hub onto a cluster: the checkpoint each GPU resumed from is on
    the hub (each node pulled its own), never on the head. A GPU failing before any newer
    checkpoint passed rolls back to exactly that one, as on one machine."""
    from launcher.pod.manifest import ManifestEntry
    sup, backend, clock = make(stage=3)
    backend.files_here = False                      # the nodes hold the files
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
    pod: launcher/supervise/ray_node.py push_as_pod) is refused; the backend reports it
    (RayBackend._harvest_pushes), and from then on no passed checkpoint is handed to the
    nodes to push, the launcher's manifest push stops too, and events and status say so."""
    import time

    from launcher.hub import open_store
    from launcher.hub.lease import RunTakenOver, pod_id, take_over
    from launcher.hub.sync import read_sync_state
    from launcher.supervise.ray_node import push_as_pod
    sup, backend, clock = make(stage=1)
    sup.use_backend(backend)
    sup.starter.start_all()
    pod_dir = sup.pod.pod_dir
    store = open_store(sup.pod.plan.config.hub, pod_dir)
    hub_path = sup.pod.plan.config.checkpoint_path(0)

    def node_push(event) -> str:
        return push_as_pod(store.url, pod_dir, pod_id(pod_dir), hub_path, pod_dir / hub_path,
                           event["sha256"], "node push")

    first = passed_checkpoint(sup, backend, 0)
    revision = node_push(first)
    (record,) = [r for g, r in backend.passed if g == 0]
    backend.hub[0] = {**record, "path": hub_path, "hub_revision": revision}
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
    assert len(backend.passed) == 2                 # this one was handed over, and refused:
    with pytest.raises(RunTakenOver) as refused:
        node_push(second)
    backend.stop_pushes(str(refused.value))
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
    backend.hub[0] = {**backend.passed[1][1], "path": hub_path, "hub_revision": taken}
    for _ in range(5):
        sup.step()
    assert sup.pod.index.records[(0, third["sha256"])]["verdict"] == PASSED
    assert len(backend.passed) == 2                  # no further checkpoint goes to a node
    assert len(events(sup, "sync_pushed", reason="manifest")) == 1
    assert store.head() == taken                     # the manifest push stopped too
    assert len(events(sup, "hub_taken_over")) == 1
