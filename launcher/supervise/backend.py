"""What runs the workers: processes only, as TorchElastic's agent (the worker contract:
docs/WORKER.md). A checkpoint once written is the custodian's (custodian.py); checks,
rollback and the manifest the supervisor's, the same for every backend."""

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
    """A worker's exit code, or the loss of its machine. `error`: a backend failure on its
    behalf (a remote call raised); the worker was killed and counts as crashed."""
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
        """SIGTERM all (each checkpoints), SIGKILL after `grace_s`; each GPU's exit."""

    def metrics_file(self, gpu: int) -> Path:
        """Where the supervisor reads the GPU's metrics lines on this machine."""
        return self.pod_dir / metrics_path(gpu)

    def log_file(self, gpu: int) -> Path | None:
        """The GPU's worker log on this machine (None: it is on the worker's node)."""
        return self.pod_dir / worker_log_path(gpu)

    def pump(self, force: bool = False) -> None:
        """Once per poll, before metrics are read: a remote backend copies lines here."""

    def settling(self, handle: WorkerHandle) -> bool:
        """Adopting or fencing the worker by its own deadline: its silence is no hang."""
        return False

    def can_place(self, slot: Slot) -> bool:
        """Whether a device is free for a GPU that lost its node."""
        return True

    def close(self) -> None:
        """Release the backend's resources (after the custodian's last pushes)."""
