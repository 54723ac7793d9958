"""What the supervisor asks of whatever runs its workers.

A backend starts one worker per GPU with the environment the launcher decided (the worker
contract of docs/WORKER.md), tells whether it exited and with which code, whether the
machine under it is gone, delivers signals, and says where the worker's metrics file can be
read on the launcher's machine. Everything else (health checks, checkpoint verdicts,
rollback, the manifest) stays in the supervisor and is the same for every backend.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

from launcher.config.devices import Slot
from launcher.worker.process import WorkerSpec, metrics_path


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
    # Whether the workers' checkpoints are on the launcher's disk (the launcher checks and
    # restores them before a restart), or on the nodes (the node does).
    files_here = True
    # Once another pod holds the run's hub lease (launcher/hub/lease.py): the refusal's one
    # line. A remote backend's nodes push no checkpoint any more.
    taken_over: str | None = None

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

    def pump(self, force: bool = False) -> None:
        """Called once per poll before the metrics are read (a remote backend copies new
        metrics lines to the launcher's machine here, at its own cadence unless `force`)."""

    def can_place(self, slot: Slot) -> bool:
        """Whether a device is free for a GPU that lost its node."""
        return True

    def hub_copy(self, gpu: int) -> dict | None:
        """The newest passed checkpoint of `gpu` the hub holds, as a checkpoint-index record
        plus `hub_revision`, for a GPU whose node was lost (None: the hub holds none)."""
        return None

    def on_passed(self, gpu: int, record: dict) -> None:
        """A checkpoint of `gpu` passed its checks (a remote backend pushes it to the hub)."""

    def node_probes(self):
        """Where AR probes run when the checkpoints are not on this machine (an object for
        ProbeMonitor.use_nodes); None: on this machine."""
        return None

    def stop_pushes(self, message: str) -> None:
        """Another pod writes the run now (`message`: the refusal): nothing more is pushed."""
        self.taken_over = message

    def take_pushed(self) -> list[dict]:
        """Checkpoints pushed to the hub since the last call: hub_copy records plus "node"."""
        return []

    def close(self, abandoned=lambda: False) -> None:
        """The run ended: finish what is in flight and release the backend's resources."""
