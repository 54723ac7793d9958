"""One GPU's slot in the supervisor: its worker process, health and restart history."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from launcher.health import GpuHealth
from launcher.podconfig import Slot
from launcher.workers import MetricsTail

RUNNING, BACKOFF, DONE, STOPPED, GPU_FAILED = "running", "backoff", "done", "stopped", "failed"


@dataclass
class GpuRun:
    slot: Slot
    tail: MetricsTail
    health: GpuHealth | None = None
    proc: object = None
    state: str = RUNNING
    started_at: float = 0.0
    last_line_at: float | None = None
    restarts: deque = field(default_factory=deque)
    restart_at: float = 0.0
    exit_code: int | None = None
    last_metrics: dict | None = None
    last_error: str | None = None
    verified_seen: tuple | None = None
