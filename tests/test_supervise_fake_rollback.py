"""Rollbacks across launchers and pod files that vanish, on the fake backend (no processes,
a fake clock: tests/support/fake_supervisor.py): a decided rollback survives a launcher killed
while carrying it out; a rollback request belongs to the launcher it was made to and is refused
during a canary; a metrics file replaced by a directory is a pod error; a GPU none of whose
checkpoints passed starts over when rolled back by hand.
"""

import signal

import pytest

from launcher.hub import open_store
from launcher.pod.ckpt_index import FAILED, CheckpointIndex
from launcher.pod.manifest import read_manifest
from launcher.supervise.custodian import CheckpointCustodian
from launcher.supervise.state import PodState
from tests.support.hub_manifest import manifest_on_hub
from tests.support.fake_supervisor import (  # noqa: F401 (fixtures)
    events,
    make,
    passed_checkpoint,
    pod_state,
    pod_template,
)


class LauncherKilled(BaseException):
    """Stands for a SIGKILL of the launcher: nothing after it runs."""


def test_a_rollback_decided_survives_a_launcher_killed_while_carrying_it_out(make, monkeypatch):
    """Issue 16 item 25. Seen: a launcher killed between a failed check and its rollback
    (state rolling_back) forgot the check: the relaunch resumed the GPU from the unjudged
    checkpoint at the old stage. The decision is recorded before anything is stopped, and
    the next launch completes it before it reads anything else."""
    from launcher.paths import DECIDED_ROLLBACK_FILE
    from launcher.pod.events import EventLog
    from launcher.supervise.plan import load_plan
    from launcher.supervise.prepare import complete_decided_rollback
    sup, backend, clock = make(stage=3)
    sup.starter.start_all()
    good = passed_checkpoint(sup, backend, 0)
    backend.train(0, 10)
    unjudged = backend.checkpoint(0)
    backend.train(1, 30)
    sup.step()                                   # the unjudged checkpoint is in the manifest

    def killed(handles, grace_s):                # the launcher dies in the graceful stop
        raise LauncherKilled()
    monkeypatch.setattr(backend, "stop", killed)
    backend.event(0, "nan", step=112)
    with pytest.raises(LauncherKilled):
        sup.step()
    assert sup.pod.state is PodState.ROLLING_BACK
    pod_dir = sup.pod.pod_dir
    assert read_manifest(pod_dir / sup.pod.plan.config.manifest).entries[0]["start_token"] \
        == unjudged["next_token"]

    # The next plain launch (no --stage), through launch's own preparation steps.
    plan, manifest = load_plan(pod_dir, None, "cpu:2", None)
    custodian = CheckpointCustodian.for_plan(plan, manifest, EventLog(pod_dir))
    plan = complete_decided_rollback(plan, manifest, custodian, stage_given=False)
    custodian.reconcile(plan.stage)
    custodian.never_resume_failed()
    entry = read_manifest(pod_dir / plan.config.manifest).entries[0]
    assert entry["start_token"] == good["next_token"] and entry["stage"] == 2
    assert plan.stage == 2
    assert CheckpointIndex(pod_dir).records[(0, unjudged["sha256"])]["verdict"] == FAILED
    (done,) = events(sup, "rollback", gpu=0)
    assert done["completed_at_launch"] and done["to_token"] == good["next_token"]
    assert not (pod_dir / DECIDED_ROLLBACK_FILE).exists()


def test_a_rollback_request_made_to_another_launcher_is_dropped_not_carried_out(make):
    """Issue 16 item 24. Seen: a rollback asked of one launcher fired in a later, unrelated
    launch 0.6 s after it started (fresh workers killed, stage 3 -> 2). A request belongs to
    the launcher it was made to."""
    from launcher.pod.live_state import write_rollback_request
    sup, backend, clock = make(stage=3)
    sup.pod.launcher_id = "this-launcher"
    write_rollback_request(sup.pod.pod_dir, 2, [0])          # asked of an earlier launcher
    sup.starter.start_all()
    passed_checkpoint(sup, backend, 0)
    sup.step()
    assert not events(sup, "rollback") and sup.pod.stage == 3
    assert [w.signals for w in backend.started] == [[], []]
    (stale,) = events(sup, "rollback_request_stale")
    assert stale["to_stage"] == 2 and "another launcher" in stale["reason"]
    assert not (sup.pod.pod_dir / "logs" / "rollback_request.json").exists()


def test_a_rollback_asked_during_the_canary_is_refused_not_fired_later(make):
    """Issue 16 item 24. Seen: a rollback asked while the stage canary ran was neither
    applied nor refused. The CLI refuses it while the canary runs; one that slips in (asked
    just before the canary began) is refused, in the events, when the canary ends."""
    from launcher.errors import UserError
    from launcher.pod.live_state import write_rollback_request
    from launcher.pod.lock import PodLock
    from launcher.cli.rollback_probe import manual_rollback
    sup, backend, clock = make(stage=3)
    pod_dir = sup.pod.pod_dir
    refused_by_cli = []

    def canary():
        try:
            manual_rollback(pod_dir, 2, [0])
        except UserError as exc:
            refused_by_cli.append(str(exc))
        write_rollback_request(pod_dir, 2, [0], sup.pod.launcher_id)
    with PodLock(pod_dir) as lock:
        sup.pod.launcher_id = lock.launcher_id
        sup.gate(canary)
        assert refused_by_cli and "stage canary" in refused_by_cli[0]
        (refused,) = events(sup, "rollback_refused")
        assert "canary" in refused["reason"] and refused["to_stage"] == 2
        sup.starter.start_all()
        sup.step()
    assert not events(sup, "rollback") and sup.pod.stage == 3
    assert sup.pod.state is PodState.RUNNING


def test_a_metrics_file_replaced_by_a_directory_is_a_pod_error_not_a_traceback(make,
                                                                               monkeypatch):
    """Issue 16 item 26. Seen: a worker's metrics file replaced by a directory mid-run ended
    the launcher with an IsADirectoryError traceback. Now the run loop ends the pod FAILED
    with one line, every worker stopped gracefully."""
    sup, backend, clock = make()
    metrics = backend.metrics_file(0)
    pump = backend.pump

    def replace_then_pump(force=False):
        if metrics.is_file():
            metrics.unlink()
            metrics.mkdir()
        return pump(force)
    monkeypatch.setattr(backend, "pump", replace_then_pump)
    assert sup.run() == 1
    assert sup.pod.state is PodState.FAILED
    (failed,) = events(sup, "pod_failed")
    assert "went away or was replaced" in failed["reason"] and "metrics_gpu0" in failed["reason"]
    assert [w.signals for w in backend.started] == [[signal.SIGTERM], [signal.SIGTERM]]


def test_rollback_by_hand_of_a_gpu_none_of_whose_checkpoints_passed_starts_it_over(make):
    """Issue 16 item 22. Seen: `rollback --gpu 0` of a GPU whose checkpoints never passed
    said "no passed checkpoint" although the docs promise such a GPU starts over at token 0."""
    from launcher.cli.rollback_probe import manual_rollback
    sup, backend, clock = make(stage=3)
    sup.starter.start_all()
    backend.train(0, 10)
    unjudged = backend.checkpoint(0)
    sup.stop_reason = "SIGTERM received"
    sup.step()
    pod_dir = sup.pod.pod_dir
    assert "starts over at token 0" in manual_rollback(pod_dir, 2, [0])
    entry = read_manifest(pod_dir / sup.pod.plan.config.manifest).entries[0]
    assert (entry.start_token, entry.checkpoint, entry.stage) == (0, None, 2)
    assert CheckpointIndex(pod_dir).records[(0, unjudged["sha256"])]["verdict"] == FAILED
    assert (pod_dir / "checkpoints" / "fractus_1b_gpu0.pt.failed").is_file()
    assert not (pod_dir / "checkpoints" / "fractus_1b_gpu0.pt").exists()


def test_an_automatic_rollback_is_pushed_to_the_hub_at_once_not_at_the_interval(make):
    """Issue 18. Seen: a rollback never reached the hub (the next push came an interval
    later, or was skipped for holding the same checkpoints); `launch --from-hub` resumed at
    the stage rolled back from. The rollback asks the sync for a push at its next tick."""
    sup, backend, clock = make(stage=3)          # hub: file://hub, sync interval: one hour
    pod_dir = sup.pod.pod_dir
    sup.starter.start_all()
    for gpu in (0, 1):
        passed_checkpoint(sup, backend, gpu)
    assert not events(sup, "sync_pushed")           # the interval is not due
    backend.event(0, "nan", step=102)
    sup.step()
    assert sup.pod.stage == 2 and events(sup, "rollback", gpu=0)
    assert sup.pod.custodian.sync.busy, "the rollback asked for no push"
    sup.pod.custodian.sync._thread.join(120)                       # the push it asked for
    sup.step()
    (pushed,) = events(sup, "sync_pushed")
    assert pushed["reason"] == "rollback"
    assert open_store("file://hub", pod_dir).head() == pushed["revision"]
    on_hub = manifest_on_hub(pod_dir, pushed["revision"])
    assert on_hub.recorded_stage() == 2 and on_hub.entries[0].stage == 2


def test_a_stage_switch_at_launch_is_pushed_to_the_hub_at_once(make):
    """Issue 18: the stage a launch switches to is recorded in the manifest before any
    worker starts, and pushed at the first tick (the hub's copy named the stage below)."""
    from launcher.pod.events import EventLog
    from launcher.supervise.plan import load_plan
    from launcher.supervise.supervisor import Supervisor
    from tests.support.fake_backend import FakeBackend
    sup, backend, clock = make(stage=2)          # hub: file://hub
    pod_dir = sup.pod.pod_dir
    sup.starter.start_all()
    for gpu in (0, 1):
        passed_checkpoint(sup, backend, gpu)
    sup.stop_reason = "SIGTERM received"
    sup.step()
    sup.pod.custodian.sync.finish()
    (at_stage_2,) = events(sup, "sync_pushed")

    plan, manifest = load_plan(pod_dir, 3, "cpu:2", None)
    log = EventLog(pod_dir)
    switched = Supervisor(plan, manifest, CheckpointCustodian.for_plan(plan, manifest, log), log,
                          backend=FakeBackend(pod_dir), clock=clock)
    switched.stop_reason = "SIGTERM received"      # the first turn of the loop stops it
    switched.run()
    pushes = events(sup, "sync_pushed")
    assert [p["reason"] for p in pushes] == ["stop", "stage switch"], pushes
    assert manifest_on_hub(pod_dir, pushes[-1]["revision"]).recorded_stage() == 3
    assert at_stage_2["revision"] != pushes[-1]["revision"]
