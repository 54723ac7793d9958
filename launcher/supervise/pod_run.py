"""What the supervisor's components share about the run (the supervisor builds it). The pod's
state moves only through `move` (state.py's table); a checkpoint's facts only through the
custodian."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from launcher.checks.probe_monitor import ProbeMonitor
from launcher.pod.events import EventLog
from launcher.pod.manifest import Manifest
from launcher.supervise.backend import WorkerBackend
from launcher.supervise.custodian import CheckpointCustodian
from launcher.supervise.gpu_run import GpuRun
from launcher.supervise.plan import LaunchPlan
from launcher.supervise.state import PodEvent, PodState, transition

if TYPE_CHECKING:           # tracker_sink imports nothing of the supervisor's at run time
    from launcher.supervise.tracker_sink import TrackerSink


@dataclass
class PodRun:
    plan: LaunchPlan
    manifest: Manifest
    events: EventLog
    backend: WorkerBackend               # runs the workers' processes
    custodian: CheckpointCustodian       # their checkpoints: index, pushes, copies, lease
    clock: object                        # the monotonic clock of hang and backoff timing
    runs: dict[int, GpuRun]
    probes: ProbeMonitor | None
    stage: int
    state: PodState = PodState.STARTING
    reason: str = ""                     # why the pod stopped or failed, for `status`
    exit_code: int = 0
    rolled_back: bool = False            # an automatic rollback happened: never twice
    judging: bool = False                # the final probes of a clean end are running
    started_at: float = field(default_factory=time.time)
    launcher_id: str | None = None       # the pod lock's: requests made to this launcher
    logs_id: tuple | None = None         # logs/ as the run began (device, inode)
    files_lost: bool = False             # logs/ or a file in it went away: nothing more written
    tracker: "TrackerSink | None" = None

    @property
    def pod_dir(self) -> Path:
        return self.plan.pod_dir

    def move(self, event: PodEvent, reason: str | None = None,
             exit_code: int | None = None) -> PodState:
        """Move the pod's state on `event`, with why (`status`) and the exit code if given."""
        self.state = transition(self.state, event)
        if reason is not None:
            self.reason = reason
        if exit_code is not None:
            self.exit_code = exit_code
        return self.state

    def use_backend(self, backend: WorkerBackend, runs: dict[int, GpuRun]) -> None:
        """Its workers run on `backend`, one GpuRun per GPU."""
        self.backend, self.runs = backend, runs

    def probes_off(self) -> None:
        self.probes = None

    def logs_opened(self, logs_id: tuple | None) -> None:
        """logs/ as the run began (device, inode)."""
        self.logs_id = logs_id

    def lost_files(self) -> None:
        """logs/ or a file in it went away: nothing more is written."""
        self.files_lost = True

    def judging_final(self, judging: bool) -> None:
        """The final probes of a clean end run (True) or ended (False)."""
        self.judging = judging

    def rolling_back(self, auto: bool) -> None:
        """A rollback happens; an automatic one is remembered (never twice)."""
        self.rolled_back = self.rolled_back or auto

    def at_stage(self, stage: int) -> None:
        self.stage = stage

    def running(self) -> bool:
        return self.state == PodState.RUNNING
