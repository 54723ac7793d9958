"""One GPU's slot in the supervisor, changed only through these methods: its worker's handle
moves with its state (only `started` enters RUNNING; no event leaves a state while a worker
is held), and a move state.py's table lacks raises."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from launcher.checks.criteria import RestartPolicy
from launcher.checks.health import GpuHealth
from launcher.config.devices import Slot
from launcher.supervise.backend import WorkerExit, WorkerHandle
from launcher.supervise.state import GpuEvent, GpuState, IllegalTransition, transition
from launcher.worker.process import MetricsTail


@dataclass
class GpuRun:
    slot: Slot
    tail: MetricsTail
    health: GpuHealth | None = None
    proc: WorkerHandle | None = None     # the running worker (started, ended, stopped)
    state: GpuState = GpuState.PENDING
    node: str | None = None              # where its worker runs or last ran (Ray)
    started_at: float = 0.0
    last_line_at: float | None = None
    restarts: deque = field(default_factory=deque)
    restart_at: float = 0.0
    exit_code: int | None = None
    last_metrics: dict | None = None
    last_error: str | None = None        # the worker's last error (event, else its log)
    error_reported: bool = False         # this run's worker wrote an `error` event
    done_reason: str | None = None       # its worker's `done` event: why it ended (this start)
    done_at: tuple | None = None         # ... and where: (phase, next_token)
    verified_seen: tuple | None = None
    announced_wait: bool = False         # its gpu_waiting event is out
    peer_marks: dict = field(default_factory=dict)   # kind -> why it is off its peers now
    merge_waiting: bool = False          # its worker waits at a merge round's boundary

    def started(self, handle: WorkerHandle, now: float) -> None:
        """RUNNING with `handle`; this start's facts begin anew."""
        self.state = transition(self.state, GpuEvent.STARTED)
        self.proc, self.node, self.exit_code = handle, handle.node, None
        self.done_reason, self.done_at = None, None
        self.started_at, self.last_line_at, self.error_reported = now, None, False
        self.merge_waiting = False

    def placed(self) -> None:
        """Where its worker runs, once a remote backend placed it."""
        if self.proc is not None and self.proc.node:
            self.node = self.proc.node

    def ended(self, ended: WorkerExit) -> None:
        """Its worker ended: the handle goes, the exit code stays (its event is applied next)."""
        self.proc, self.exit_code = None, ended.code

    def crashed(self, now: float, policy: RestartPolicy) -> float | None:
        """A crash at `now`: BACKOFF, returning the delay; past `policy`'s budget FAILED (None)."""
        self.restarts.append(now)
        while self.restarts and self.restarts[0] < now - policy.window_s:
            self.restarts.popleft()
        if len(self.restarts) > policy.max_restarts:
            self.apply(GpuEvent.GAVE_UP)
            return None
        delay = policy.backoff(len(self.restarts))
        self.apply(GpuEvent.CRASHED)
        self.restart_at = now + delay
        return delay

    def checked_by(self, health: GpuHealth) -> None:
        """Its checks from now on (a fresh start's)."""
        self.health = health

    def said_metrics(self, record: dict, now: float) -> None:
        """Its worker wrote a metrics line at `now`."""
        self.last_line_at, self.last_metrics = now, record

    def said_merge_wait(self, now: float) -> None:
        """Its worker waits at a round boundary: silent by design until the round decides."""
        self.merge_waiting, self.last_line_at = True, now

    def said_merge_resumed(self, now: float) -> None:
        """Its worker took (or passed on) the round and trains again: silence counts anew."""
        self.merge_waiting, self.last_line_at = False, now

    def said_done(self, reason: str, at: tuple | None = None) -> None:
        """Its worker's `done` event: why it ended, and where when it said (phase, next_token)."""
        self.done_reason = reason
        if at is not None:
            self.done_at = at

    def said_error(self, message: str) -> None:
        """Its worker's `error` event."""
        self.last_error, self.error_reported = message, True

    def ended_with(self, error: str) -> None:
        """Why it ended, as the launcher saw it (an exit code's cause, a hang)."""
        self.last_error = error

    def announced(self, wait: bool) -> None:
        """Whether its gpu_waiting event is out."""
        self.announced_wait = wait

    def saw_verified(self, seen: tuple) -> None:
        """The (verified step, index changes) last judged."""
        self.verified_seen = seen

    def stopped(self) -> None:
        """The pod stopped its worker (or it had none): STOPPED."""
        self.proc = None
        self.apply(GpuEvent.STOPPED)

    def apply(self, event: GpuEvent) -> GpuState:
        if event is GpuEvent.STARTED:
            raise IllegalTransition("a GPU starts only with its worker's handle (started)")
        if self.proc is not None:
            raise IllegalTransition(f"GPU {self.slot.gpu} still holds a running worker: "
                                    f"{event.name} needs it ended first")
        self.state = transition(self.state, event)
        return self.state
