"""What the supervisor asks of whatever runs its workers: processes, and nothing else.

As TorchElastic's agent: a backend starts one worker per GPU with the environment the
launcher decided (the worker contract of docs/WORKER.md), tells whether it exited and with
which code, whether the machine under it is gone, delivers signals, stops and closes, and
says where the worker's files (metrics, log) can be read on the launcher's machine.
Everything about a checkpoint once written (verdicts, pushes, restores, the hub lease) is
the checkpoint custodian's (launcher/supervise/custodian.py); health checks, rollback and
the manifest stay in the supervisor, the same for every backend.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

from launcher.config.devices import Slot
from launcher.paths import metrics_path, worker_log_path
from launcher.worker.process import WorkerSpec


@dataclass
class WorkerHandle:
    """One started worker. `pid` and `node` are for events and `status` only."""
    gpu: int
    pid: int | None
    node: str | None = None


@dataclass(frozen=True)
class WorkerExit:
    """How a worker ended: its exit code, or the loss of the machine it ran on. `error`:
    what failed in the backend itself on the worker's behalf (a remote call that raised);
    the worker was then killed, and the GPU is handled as a crashed worker."""
    code: int | None
    node_lost: bool = False
    error: str | None = None


class WorkerBackend(ABC):
    name = "backend"

    def __init__(self, pod_dir: Path):
        self.pod_dir = pod_dir

    @abstractmethod
    def start(self, spec: WorkerSpec) -> WorkerHandle:
        """Start the worker `spec` describes; returns at once."""

    @abstractmethod
    def poll(self, handle: WorkerHandle) -> WorkerExit | None:
        """None while the worker runs; how it ended otherwise (asked once per poll)."""

    @abstractmethod
    def signal(self, handle: WorkerHandle, signum: int) -> None:
        """Deliver `signum` to the worker (no error if it already exited)."""

    @abstractmethod
    def kill(self, handle: WorkerHandle) -> WorkerExit:
        """SIGKILL the worker and wait for it: no save, no further line."""

    @abstractmethod
    def stop(self, handles: list[WorkerHandle], grace_s: float) -> dict[int, WorkerExit]:
        """SIGTERM every worker (it finishes its step and checkpoints), SIGKILL those still
        running after `grace_s`; returns each GPU's exit."""

    def metrics_file(self, gpu: int) -> Path:
        """Where the supervisor reads the GPU's metrics lines on this machine."""
        return self.pod_dir / metrics_path(gpu)

    def log_file(self, gpu: int) -> Path | None:
        """The GPU's worker log on this machine (None: it is on the worker's node)."""
        return self.pod_dir / worker_log_path(gpu)

    def pump(self, force: bool = False) -> None:
        """Called once per poll before the metrics are read (a remote backend copies new
        metrics lines to the launcher's machine here, at its own cadence unless `force`)."""

    def settling(self, handle: WorkerHandle) -> bool:
        """The backend is taking over the worker itself (a remote one: its node's actor
        died, and a new actor adopts the GPU or its node is fenced), by a deadline of its
        own: its silence is no hang meanwhile."""
        return False

    def can_place(self, slot: Slot) -> bool:
        """Whether a device is free for a GPU that lost its node."""
        return True

    def close(self) -> None:
        """The run ended (the custodian's last pushes are done): release the backend's
        resources."""
