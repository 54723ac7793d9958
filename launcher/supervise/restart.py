"""The restart policy (the criteria's `restarts` and `hang` sections): a crashed worker
backs off and restarts until too many crashes fall within the window, then its GPU fails
its checks; a worker silent past its limit counts as hung."""

from __future__ import annotations

from launcher.supervise.gpu_run import GpuRun
from launcher.supervise.pod_run import PodRun
from launcher.supervise.state import GpuState


class WorkerRestarter:
    def __init__(self, pod: PodRun):
        self.pod = pod

    def crash(self, run: GpuRun, reason: str) -> None:
        """`run`'s worker ended badly: BACKOFF, or past the budget a failed `restarts` check."""
        policy = self.pod.plan.criteria.restarts
        delay = run.crashed(self.pod.clock(), policy)
        if delay is None:
            why = f"{len(run.restarts)} crashes within {policy.window_s:g}s (last: {reason})"
            self.pod.events.emit("gpu_given_up", gpu=run.slot.gpu, reason=why)
            run.health.fail("restarts", why)
            return
        self.pod.events.emit("worker_crash", gpu=run.slot.gpu, reason=reason,
                             restart_in_s=delay, restarts=len(run.restarts))

    def due(self, run: GpuRun, now: float) -> bool:
        """A BACKOFF GPU whose delay is over, in a pod that still runs."""
        return run.state == GpuState.BACKOFF and now >= run.restart_at and self.pod.running()

    def silence(self, run: GpuRun, now: float) -> tuple[float, float] | None:
        """(seconds silent, limit) when past it; the first line has the startup limit."""
        hang = self.pod.plan.criteria.hang
        since = run.last_line_at if run.last_line_at is not None else run.started_at
        limit = hang.timeout_s if run.last_line_at is not None else hang.startup_timeout_s
        return (now - since, limit) if now - since > limit else None
