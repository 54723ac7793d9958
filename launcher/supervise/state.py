"""The GPU and pod states; every change goes through `transition(state, event)`, and a move
the table lacks is a bug raised at once (IllegalTransition). The values are the strings
`status` and logs/pod_state.json show: do not rename them."""

from __future__ import annotations

from enum import Enum

from fractus.train.exit_codes import WorkerExitCode


class _Named(str, Enum):
    def __str__(self) -> str:          # "running" in f-strings and json, as before
        return self.value


class GpuState(_Named):
    PENDING = "pending"      # not started yet (the canary runs first)
    RUNNING = "running"      # a worker runs (or is being placed by the backend)
    BACKOFF = "backoff"      # crashed; restarts at restart_at
    WAITING = "waiting"      # its node was lost and no node has a free device for it yet
    DONE = "done"            # the worker finished (end of shard, --max-steps): exit 0
    STOPPED = "stopped"      # stopped by the pod (stop, rollback, failure of another GPU)
    FAILED = "failed"        # failed its checks, refused its settings, or crashed too often


class GpuEvent(Enum):
    STARTED = "started"              # a worker was started for the GPU
    FINISHED = "finished"            # exit 0 while the pod runs
    CRASHED = "crashed"              # exit 1/a signal/a hang, within the restart budget
    GAVE_UP = "gave_up"              # a crash past the restart budget
    REFUSED = "refused"              # exit 2: bad settings or files; restarting cannot fix it
    CHECK_EXIT = "check_exit"        # exit 3 (NaN) or 4 (OOM): the worker failed a check
    DISK_FULL = "disk_full"          # exit 5: the worker could not write; nothing progresses
    STOPPED = "stopped"              # the pod stopped it, or it exited while the pod stops
    NODE_LOST = "node_lost"          # the machine it ran on is gone


class PodState(_Named):
    STARTING = "starting"
    CANARY = "canary"                # the stage canary runs before the switch up
    RUNNING = "running"
    ROLLING_BACK = "rolling_back"
    STOPPING = "stopping"
    FAILING = "failing"
    STOPPED = "stopped"
    DONE = "done"
    FAILED = "failed"


class PodEvent(Enum):
    CANARY_STARTED = "canary_started"
    CANARY_PASSED = "canary_passed"
    CANARY_REFUSED = "canary_refused"  # nothing switched, nothing started
    STARTED = "started"              # every worker started
    ALL_DONE = "all_done"            # every worker done or stopped, no probe in flight
    ROLLBACK = "rollback"
    STOP = "stop"
    STOPPED = "stopped"
    FAIL = "fail"
    FAILED = "failed"


class IllegalTransition(RuntimeError):
    pass


_ANY_GPU = tuple(GpuState)
_LIVE_POD = (PodState.STARTING, PodState.CANARY, PodState.RUNNING, PodState.ROLLING_BACK,
             PodState.STOPPING)

TRANSITIONS: dict[tuple[Enum, Enum], Enum] = {
    # A GPU starts from anything but a running worker: first start, restart after a crash,
    # placement after its node was lost, and every restart of a rollback.
    **{(s, GpuEvent.STARTED): GpuState.RUNNING for s in _ANY_GPU if s is not GpuState.RUNNING},
    (GpuState.RUNNING, GpuEvent.FINISHED): GpuState.DONE,
    (GpuState.RUNNING, GpuEvent.CRASHED): GpuState.BACKOFF,
    (GpuState.RUNNING, GpuEvent.GAVE_UP): GpuState.FAILED,
    (GpuState.WAITING, GpuEvent.GAVE_UP): GpuState.FAILED,   # lost node, nothing to resume
    (GpuState.RUNNING, GpuEvent.REFUSED): GpuState.FAILED,
    (GpuState.RUNNING, GpuEvent.CHECK_EXIT): GpuState.FAILED,
    (GpuState.RUNNING, GpuEvent.DISK_FULL): GpuState.FAILED,
    (GpuState.BACKOFF, GpuEvent.GAVE_UP): GpuState.FAILED,   # its checkpoint is nowhere
    **{(s, GpuEvent.STOPPED): GpuState.STOPPED for s in _ANY_GPU},
    **{(s, GpuEvent.NODE_LOST): GpuState.WAITING
       for s in (GpuState.RUNNING, GpuState.BACKOFF, GpuState.WAITING)},

    (PodState.STARTING, PodEvent.CANARY_STARTED): PodState.CANARY,
    (PodState.CANARY, PodEvent.CANARY_PASSED): PodState.STARTING,
    (PodState.CANARY, PodEvent.CANARY_REFUSED): PodState.STOPPED,
    (PodState.STARTING, PodEvent.STARTED): PodState.RUNNING,
    (PodState.ROLLING_BACK, PodEvent.STARTED): PodState.RUNNING,
    (PodState.RUNNING, PodEvent.ALL_DONE): PodState.DONE,
    (PodState.RUNNING, PodEvent.ROLLBACK): PodState.ROLLING_BACK,
    (PodState.RUNNING, PodEvent.STOP): PodState.STOPPING,
    (PodState.STOPPING, PodEvent.STOPPED): PodState.STOPPED,
    **{(s, PodEvent.FAIL): PodState.FAILING for s in _LIVE_POD},
    (PodState.FAILING, PodEvent.FAILED): PodState.FAILED,
}


def transition(state: GpuState | PodState, event: GpuEvent | PodEvent) -> GpuState | PodState:
    """The state `event` moves `state` to; IllegalTransition for a move the table lacks."""
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise IllegalTransition(f"{type(state).__name__}.{state.name} has no transition on "
                                f"{type(event).__name__}.{event.name}") from None


def exit_event(code: int, pod_running: bool) -> GpuEvent:
    """What a worker's exit code means for its GPU (before the restart budget is applied)."""
    if not pod_running:
        return GpuEvent.STOPPED
    if code == WorkerExitCode.OK:
        return GpuEvent.FINISHED
    if code == WorkerExitCode.SETTINGS:
        return GpuEvent.REFUSED
    if code == WorkerExitCode.DISK_FULL:
        return GpuEvent.DISK_FULL
    if code in (WorkerExitCode.NAN, WorkerExitCode.OOM):
        return GpuEvent.CHECK_EXIT
    return GpuEvent.CRASHED


FINISHED_GPU_STATES = (GpuState.DONE, GpuState.STOPPED)
ENDED_POD_STATES = (PodState.STOPPED, PodState.DONE, PodState.FAILED)
