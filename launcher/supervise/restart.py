"""The restart policy (the criteria's `restarts` and `hang` sections): a crashed worker
backs off and restarts until too many crashes fall within the window, then its GPU fails
its checks; a worker silent past its limit counts as hung."""

from __future__ import annotations

from typing import Callable

from launcher.checks.criteria import Criteria
from launcher.pod.events import EventLog
from launcher.supervise.gpu_run import GpuRun
from launcher.supervise.state import GpuState


class WorkerRestarter:
    def __init__(self, criteria: Criteria, clock, events: EventLog,
                 running: Callable[[], bool]):
        """`running`: whether the pod still runs (a due restart waits for nothing else)."""
        self.criteria, self.clock, self.events, self.running = criteria, clock, events, running

    def crash(self, run: GpuRun, reason: str) -> None:
        """`run`'s worker ended badly: BACKOFF, or past the budget a failed `restarts` check."""
        policy = self.criteria.restarts
        delay = run.crashed(self.clock(), policy)
        if delay is None:
            why = f"{len(run.restarts)} crashes within {policy.window_s:g}s (last: {reason})"
            self.events.emit("gpu_given_up", gpu=run.slot.gpu, reason=why)
            run.health.fail("restarts", why)
            return
        self.events.emit("worker_crash", gpu=run.slot.gpu, reason=reason,
                             restart_in_s=delay, restarts=len(run.restarts))

    def due(self, run: GpuRun, now: float) -> bool:
        """A BACKOFF GPU whose delay is over, in a pod that still runs."""
        return run.state == GpuState.BACKOFF and now >= run.restart_at and self.running()

    def silence(self, run: GpuRun, now: float) -> tuple[float, float] | None:
        """(seconds silent, limit) when past it; the first line has the startup limit."""
        hang = self.criteria.hang
        since = run.last_line_at if run.last_line_at is not None else run.started_at
        limit = hang.timeout_s if run.last_line_at is not None else hang.startup_timeout_s
        return (now - since, limit) if now - since > limit else None
