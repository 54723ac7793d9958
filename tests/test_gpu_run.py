"""A GPU's worker handle moves with its state: only a start with a handle enters RUNNING, no
event leaves a state while the GPU still holds a worker, and an exit or a stop lets go of it
(launcher/supervise/gpu_run.py). No process: a GpuRun over a handle."""

import ast
import dataclasses
from pathlib import Path

import pytest

from launcher.checks.criteria import RestartPolicy
from launcher.config.devices import Slot
from launcher.supervise.backend import WorkerExit, WorkerHandle
from launcher.supervise.gpu_run import GpuRun
from launcher.supervise.pod_run import PodRun
from launcher.supervise.state import GpuEvent, GpuState, IllegalTransition
from launcher.worker.process import MetricsTail


def gpu_run(tmp_path) -> GpuRun:
    return GpuRun(Slot(0, "cpu"), MetricsTail(tmp_path / "metrics_gpu0.jsonl"))


def test_a_start_holds_its_handle_and_an_exit_lets_go_before_the_next_state(tmp_path):
    run = gpu_run(tmp_path)
    run.exit_code, run.done_reason = 1, "end_of_shard"     # the last start's facts
    run.started(WorkerHandle(0, 1234, node="node-a"), now=5.0)
    assert (run.state, run.proc.pid, run.node, run.started_at) == \
        (GpuState.RUNNING, 1234, "node-a", 5.0)
    assert run.exit_code is None and run.done_reason is None
    with pytest.raises(IllegalTransition, match="still holds a running worker"):
        run.apply(GpuEvent.CRASHED)
    assert run.state is GpuState.RUNNING and run.proc is not None
    run.ended(WorkerExit(1))
    assert run.proc is None and run.exit_code == 1 and run.node == "node-a"
    assert run.apply(GpuEvent.CRASHED) is GpuState.BACKOFF


def test_a_start_only_comes_with_a_handle_and_a_stop_lets_go_of_it(tmp_path):
    run = gpu_run(tmp_path)
    with pytest.raises(IllegalTransition, match="handle"):
        run.apply(GpuEvent.STARTED)
    assert run.state is GpuState.PENDING
    run.started(WorkerHandle(0, 1), now=0.0)
    with pytest.raises(IllegalTransition, match="RUNNING has no transition on GpuEvent.STARTED"):
        run.started(WorkerHandle(0, 2), now=1.0)
    assert run.proc.pid == 1                 # the refused start changed nothing
    run.stopped()
    assert run.state is GpuState.STOPPED and run.proc is None


def test_a_crash_backs_off_with_its_restart_time_and_past_the_budget_gives_up(tmp_path):
    policy = RestartPolicy(max_restarts=2, window_s=100.0, backoff_s=5.0, backoff_max_s=8.0)
    run = gpu_run(tmp_path)
    delays = []
    for now in (0.0, 10.0):
        run.started(WorkerHandle(0, 1), now=now)
        run.ended(WorkerExit(1))
        delays.append(run.crashed(now + 1, policy))
        assert run.state is GpuState.BACKOFF and run.restart_at == now + 1 + delays[-1]
    assert delays == [5.0, 8.0]                    # doubles, capped
    run.started(WorkerHandle(0, 1), now=200.0)      # the first two crashes left the window
    run.ended(WorkerExit(1))
    assert run.crashed(201.0, policy) == 5.0
    for now in (202.0, 203.0):
        run.started(WorkerHandle(0, 1), now=now)
        run.ended(WorkerExit(1))
        last = run.crashed(now + 0.5, policy)
    assert last is None and run.state is GpuState.FAILED and len(run.restarts) == 3


# Objects elsewhere in launcher/ whose fields share a GpuRun's or PodRun's name: not theirs.
OTHER_OBJECTS = {
    ("launcher/checks/canary.py", "run"): "canary's _Run",
    ("launcher/checks/canary.py", "result"): "CanaryResult",
    ("launcher/checks/health.py", "check"): "CheckState",
    ("launcher/supervise/ray/driver.py", "handle"): "a Ray worker handle",
    ("launcher/cli/launch_steps.py", "launch"): "Launch",
    ("launcher/hub/snapshot.py", "snap"): "Snapshot",
}


def _assigned_outside(cls, home: str) -> list[str]:
    """`x.field = ...` for a field of `cls`, `x` not `self`, in launcher/ outside `home`."""
    root = Path(__file__).resolve().parents[1]
    names = {f.name for f in dataclasses.fields(cls)}
    found = []
    for path in sorted((root / "launcher").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel == home:
            continue
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            targets = (node.targets if isinstance(node, ast.Assign) else
                       [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            while targets:
                target = targets.pop()
                if isinstance(target, (ast.Tuple, ast.List)):
                    targets.extend(target.elts)
                elif isinstance(target, ast.Starred):
                    targets.append(target.value)
                elif (isinstance(target, ast.Attribute) and target.attr in names
                      and ast.unparse(target.value) != "self"
                      and (rel, ast.unparse(target.value)) not in OTHER_OBJECTS):
                    found.append(f"{rel}:{target.lineno} {ast.unparse(target)}")
    return found


@pytest.mark.parametrize("cls, home", [(GpuRun, "launcher/supervise/gpu_run.py"),
                                       (PodRun, "launcher/supervise/pod_run.py")])
def test_a_runs_fields_are_set_only_by_its_own_methods(cls, home):
    assert _assigned_outside(cls, home) == []
