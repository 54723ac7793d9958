"""One rule for a GPU that fails its checks before any checkpoint of it passed: the pod keeps
its healthy GPUs and runs on at the stage below; the failed GPU starts over at token 0 with
its own files set aside. The rule is decided and recorded (a `rollback_decided` event and
logs/rollback_decided.json) before anything is stopped, so a launcher alive throughout and
a launcher killed in the middle of the rollback, then launched again, end the same way.

On the fake backend (no processes, a fake clock: tests/support/fake_supervisor.py).
"""

from launcher.paths import DECIDED_ROLLBACK_FILE
from launcher.pod.ckpt_index import FAILED, CheckpointIndex
from launcher.pod.events import read_events
from launcher.pod.manifest import read_manifest
from launcher.supervise.state import PodState
from tests.support.fake_supervisor import (  # noqa: F401 (fixtures)
    events,
    killed_mid_rollback,
    make,
    passed_checkpoint,
    pod_template,
    prepare_relaunch,
)


def fail_gpu0_before_anything_of_it_passed(sup, backend) -> tuple[dict, dict]:
    """GPU 1 has a passed checkpoint; GPU 0 wrote one that is not judged yet, then its loss
    goes NaN. Returns (GPU 0's unjudged checkpoint, GPU 1's passed one)."""
    sup.starter.start_all()
    healthy = passed_checkpoint(sup, backend, 1)
    backend.train(0, 10)
    unjudged = backend.checkpoint(0)
    sup.step()
    assert sup.pod.custodian.index.records[(0, unjudged["sha256"])]["verdict"] == "pending"
    backend.event(0, "nan", step=11)
    return unjudged, healthy


def assert_the_rule_held(pod_dir, manifest_path, unjudged, healthy) -> None:
    entries = read_manifest(manifest_path).entries
    # The failed GPU: back to where it began, at the stage below, its files set aside.
    assert (entries[0].start_token, entries[0].checkpoint, entries[0].stage) == (0, None, 2)
    assert (pod_dir / "checkpoints" / "fractus_1b_gpu0.pt.failed").is_file()
    assert not (pod_dir / "checkpoints" / "fractus_1b_gpu0.pt").exists()
    assert CheckpointIndex(pod_dir).records[(0, unjudged["sha256"])]["verdict"] == FAILED
    # The healthy GPU keeps its progress (its graceful save at the stop).
    assert entries[1].start_token > healthy["next_token"]
    assert not (pod_dir / DECIDED_ROLLBACK_FILE).exists()
    log = [e["event"] for e in read_events(pod_dir)]
    # Decided, in the event log, before the workers were stopped and the GPU rolled back.
    assert log.index("rollback_decided") < log.index("rollback")
    assert "pod_failed" not in log
    decided = [e for e in read_events(pod_dir) if e["event"] == "rollback_decided"][0]
    assert decided["gpus"] == [0] and decided["start_over"] == [0]
    assert (decided["from_stage"], decided["to_stage"]) == (3, 2)
    (rolled,) = [e for e in read_events(pod_dir) if e["event"] == "rollback"]
    assert (rolled["gpu"], rolled["to_token"], rolled["checkpoint"]) == (0, 0, None)
    assert rolled["set_aside"] == ["checkpoints/fractus_1b_gpu0.pt"]


def test_a_gpu_failing_before_anything_passed_starts_over_and_the_pod_runs_on(make):
    """Seen: with the launcher alive, a GPU failing at stage 3 before any checkpoint of it
    passed stopped the whole pod (FAILED, exit 1), while the docs' rule keeps the healthy
    GPUs and a relaunch after a kill rolled it back. Now the live launcher applies the rule."""
    sup, backend, clock = make(stage=3)
    unjudged, healthy = fail_gpu0_before_anything_of_it_passed(sup, backend)
    sup.step()
    assert sup.pod.state is PodState.RUNNING and sup.pod.stage == 2
    assert_the_rule_held(sup.pod.pod_dir, sup.pod.pod_dir / sup.pod.plan.config.manifest,
                         unjudged, healthy)
    restarted = [w for w in backend.started if w.gpu == 0][-1]
    assert restarted.spec.start_token == 0 and restarted.spec.ckpt_in is None
    assert restarted.spec.stage == 2
    (running,) = events(sup, "pod_running", after="rollback")
    assert running["stage"] == 2


def test_the_same_failure_with_the_launcher_killed_mid_rollback_ends_the_same_way(
        make, monkeypatch):
    """The same fault, the launcher SIGKILLed while the workers stop: the decision it
    recorded first is completed by the next launch, by the same rule."""
    sup, backend, clock = make(stage=3)
    unjudged, healthy = fail_gpu0_before_anything_of_it_passed(sup, backend)
    killed_mid_rollback(sup, backend, monkeypatch)
    assert sup.pod.state is PodState.ROLLING_BACK
    pod_dir = sup.pod.pod_dir
    assert (pod_dir / DECIDED_ROLLBACK_FILE).exists()
    assert events(sup, "rollback_decided") and not events(sup, "rollback")

    plan = prepare_relaunch(pod_dir)              # the next plain launch (no --stage)
    assert plan.stage == 2
    assert_the_rule_held(pod_dir, pod_dir / plan.config.manifest, unjudged, healthy)
