"""One GPU's slot in the supervisor: its worker, health, restart history and state."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from launcher.checks.health import GpuHealth
from launcher.config.devices import Slot
from launcher.supervise.backend import WorkerHandle
from launcher.supervise.state import GpuEvent, GpuState, transition
from launcher.worker.process import MetricsTail


@dataclass
class GpuRun:
    slot: Slot
    tail: MetricsTail
    health: GpuHealth | None = None
    proc: WorkerHandle | None = None     # the running worker, from the backend
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

    def apply(self, event: GpuEvent) -> GpuState:
        self.state = transition(self.state, event)
        return self.state
