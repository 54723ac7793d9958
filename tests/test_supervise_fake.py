"""The supervision state machine on one machine, driven through a fake backend: no
processes, a fake clock (tests/support/fake_supervisor.py).

Every transition of a GPU and of the pod (start, crash and restart, the restart budget,
hang, NaN and OOM rollback, refused settings, rollback by hand, stop, --max-time, the canary
gate, done, a clean stop's final verdicts) is exercised through the real Supervisor, health
checks, checkpoint index, manifest and event log. Remote backends (nodes):
test_supervise_fake_nodes.py, their hub pushes: test_supervise_fake_node_pushes.py; rollback
requests and decided rollbacks across launchers, and pod files that vanish:
test_supervise_fake_rollback.py.
"""

import hashlib
import signal

import pytest

from launcher.pod.ckpt_index import FAILED, PASSED
from launcher.pod.live_state import read_pod_state
from launcher.pod.manifest import read_manifest
from launcher.supervise.state import (
    GpuEvent,
    GpuState,
    IllegalTransition,
    PodEvent,
    PodState,
    exit_event,
    transition,
)
from tests.support.fake_backend import TOKENS_PER_STEP
from tests.support.fake_supervisor import (  # noqa: F401 (fixtures)
    crash_past_the_restart_budget,
    ProbeRecorder,
    events,
    make,
    passed_checkpoint,
    pod_state,
    pod_template,
)


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
    crash_past_the_restart_budget(sup, backend, clock)
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


def test_the_first_step_has_its_own_limit_for_model_load_and_compile(make):
    """A worker compiling its first step (no metrics line yet) is not hung at timeout_s
    (600 s) but only past startup_timeout_s (1200 s); the event and status say which."""
    sup, backend, clock = make()
    sup.starter.start_all()
    backend.train(1, 1)
    sup.step()
    clock.now += 1100            # GPU 0 still compiles; GPU 1 trained once, then went silent
    sup.step()
    assert sup.pod.runs[0].state is GpuState.RUNNING
    (later,) = events(sup, "hang", gpu=1)
    assert (later["phase"], later["limit_s"]) == ("training", 600)
    clock.now += 101
    sup.step()
    (first,) = events(sup, "hang", gpu=0)
    assert (first["phase"], first["limit_s"]) == ("first_step", 1200)
    assert sup.pod.runs[0].state is GpuState.BACKOFF
    assert sup.pod.runs[0].last_error == "hang: no metrics line for 1201s before its first " \
                                         "step (limit 1200s)"
    assert pod_state(sup)["gpus"]["0"]["last_error"] == sup.pod.runs[0].last_error


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
    assert [r["verdict"] for r in sup.pod.custodian.index.for_gpu(0)] == [PASSED, FAILED]
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
    record = sup.pod.custodian.index.records[(0, early["sha256"])]
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
    record = sup.pod.custodian.index.records[(0, after["sha256"])]
    assert (record["verdict"], record["reason"]) == (FAILED, "written after its GPU failed")
    assert sup.pod.state is PodState.FAILED


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


def test_a_failed_gpu_whose_passed_checkpoints_are_all_gone_fails_the_pod(make):
    """(A GPU none of whose checkpoints ever passed starts over instead:
    tests/test_rollback_never_passed.py.)"""
    sup, backend, clock = make(stage=3)
    sup.starter.start_all()
    event = passed_checkpoint(sup, backend, 0)
    record = sup.pod.custodian.index.records[(0, event["sha256"])]
    for rel in (record["retained"], record["path"]):
        (sup.pod.pod_dir / rel).unlink()
    backend.event(0, "nan", step=105)
    sup.step()
    assert sup.pod.state is PodState.FAILED and sup.pod.exit_code == 1
    assert "GPU 0 failed and none of its passed checkpoints is left intact" in \
        events(sup, "pod_failed")[0]["reason"]
    (decided,) = events(sup, "rollback_decided")
    assert decided["to_tokens"] == {"0": None} and decided["start_over"] == []


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
    last = {g: sup.pod.custodian.index.pending(g)[-1] for g in (0, 1)}
    assert {r["step"] for r in last.values()} == {131}
    sup.final.judge()
    (final,) = events(sup, "final_verdicts")
    assert {g: v["verdict"] for g, v in final["verdicts"].items()} == {"0": PASSED, "1": PASSED}
    assert [sup.pod.custodian.index.records[(g, r["sha256"])]["verdict"] for g, r in last.items()] \
        == [PASSED, PASSED]


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
    record = sup.pod.custodian.index.records[(0, newer["sha256"])]
    assert name == record["retained"]          # the pinned link, not the worker's name
    assert hashlib.sha256((sup.pod.pod_dir / name).read_bytes()).hexdigest() == newer["sha256"]
    assert sup.pod.custodian.index.records[(0, older["sha256"])]["retained"] is None



@pytest.mark.parametrize("reason", ["signal", "signal_before_first_step"])
def test_a_worker_stopped_by_someone_else_restarts_instead_of_counting_as_done(make, reason):
    """Issue 16 item 26. Seen: a worker SIGTERMed by someone else checkpoints and exits 0,
    was taken as done and never restarted: its GPU idled while the pod said running. Its
    `done` event says a signal ended it; the launcher sent none, so it restarts."""
    sup, backend, clock = make()
    sup.starter.start_all()
    backend.train(0, 10)
    ckpt = backend.checkpoint(0)
    backend.event(0, "done", reason=reason, step=10, next_token=ckpt["next_token"])
    backend.exit(0, 0)
    sup.step()
    run = sup.pod.runs[0]
    assert run.state is GpuState.BACKOFF and sup.pod.state is PodState.RUNNING
    (crash,) = events(sup, "worker_crash", gpu=0)
    assert "signal the launcher did not send" in crash["reason"]
    clock.now += crash["restart_in_s"] + 0.1
    sup.step()
    assert run.state is GpuState.RUNNING
    assert backend.current(0).spec.start_token == ckpt["next_token"]
    # Its end of shard is still the end: a `done` for that reason finishes the GPU.
    backend.event(0, "done", reason="end_of_shard", step=11, next_token=ckpt["next_token"])
    backend.exit(0, 0)
    sup.step()
    assert run.state is GpuState.DONE
