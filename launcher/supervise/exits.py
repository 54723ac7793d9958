"""The reaction to a worker's end: its exit code as a GpuEvent (state.exit_event), each to
one handler of a table; a hang; the loss of its node."""

from __future__ import annotations

from typing import Callable

from launcher.pod.events import EventLog
from launcher.supervise.backend import WorkerBackend, WorkerExit
from launcher.supervise.ending import PodEnding
from launcher.supervise.gpu_run import GpuRun
from launcher.supervise.monitor import WorkerMonitor
from launcher.supervise.phase_switch import PhaseSwitch
from launcher.supervise.placement import NodePlacement
from launcher.supervise.restart import WorkerRestarter
from launcher.supervise.state import GpuEvent, exit_event

# The worker's `done` reasons that mean a signal ended it (docs/WORKER.md), not its work.
STOPPED_BY_SIGNAL = ("signal", "signal_before_first_step")


class ExitHandlers:
    def __init__(self, events: EventLog, stage: Callable[[], int], running: Callable[[], bool],
                 backend: Callable[[], WorkerBackend], monitor: WorkerMonitor,
                 restarts: WorkerRestarter, placement: NodePlacement, ending: PodEnding,
                 phases: PhaseSwitch):
        """`stage`, `running`, `backend`: the pod's as they stand now (they change)."""
        self.events, self.stage, self.running, self.backend = events, stage, running, backend
        self.monitor, self.restarts = monitor, restarts
        self.placement, self.ending, self.phases = placement, ending, phases
        self.by_event = {
            GpuEvent.FINISHED: self.finished,
            GpuEvent.STOPPED: self.stopped,
            GpuEvent.CRASHED: self.crashed,
            GpuEvent.REFUSED: self.refused,
            GpuEvent.CHECK_EXIT: self.check_exit,
            GpuEvent.DISK_FULL: self.disk_full,
        }

    def on_exit(self, run: GpuRun, ended: WorkerExit) -> None:
        """`run`'s worker ended on its own (its last lines already read)."""
        run.ended(ended)
        if ended.node_lost:
            self.placement.on_node_lost(run)
            return
        if ended.code and not run.error_reported:
            run.ended_with(ended.error or self.worker_said(run, ended.code))
        self.events.emit("worker_exit", gpu=run.slot.gpu, code=ended.code,
                         stage=self.stage(),
                         **({"error": ended.error} if ended.error else {}))
        event = exit_event(ended.code, self.running())
        self.by_event[event](run, ended)

    def on_silence(self, run: GpuRun, now: float) -> None:
        """A running worker: killed as hung once silent past its limit, then a crash."""
        if run.proc is None or self.backend().settling(run.proc) or run.merge_waiting:
            return
        silence = self.restarts.silence(run, now)
        if silence is None:
            return
        silent_s, limit_s = silence
        # Before its first metrics line a worker loads the model and compiles (COMPILE=1:
        # minutes at 1B): that silence has its own, longer limit (startup_timeout_s).
        phase = "first_step" if run.last_line_at is None else "training"
        self.events.emit("hang", gpu=run.slot.gpu, pid=run.proc.pid,
                         silent_s=round(silent_s, 2), limit_s=limit_s, phase=phase)
        ended = self.backend().kill(run.proc)
        self.monitor.drain(run)
        run.ended(ended)
        if ended.node_lost:
            self.placement.on_node_lost(run)
            return
        run.ended_with((f"hang: no metrics line for {silent_s:.0f}s "
                        + ("before its first step" if phase == "first_step" else "")
                        + f" (limit {limit_s:g}s)").replace("  ", " "))
        self.restarts.crash(run, run.last_error)

    # ---- one handler per exit event ---------------------------------------------------
    def finished(self, run: GpuRun, ended: WorkerExit) -> None:
        if run.done_reason in STOPPED_BY_SIGNAL:
            # Exit 0 on a signal the launcher did not send (it signals only while stopping
            # the pod): the GPU must not idle while the pod says running, so it restarts.
            self.restarts.crash(run, f"stopped by a signal the launcher did not send "
                                     f"(done: {run.done_reason})")
            return
        if self.phases.switch(run):      # the end of a phase's shard: on to the next one
            return
        run.apply(GpuEvent.FINISHED)

    def stopped(self, run: GpuRun, ended: WorkerExit) -> None:      # it exited while the pod ends
        run.apply(GpuEvent.STOPPED)

    def crashed(self, run: GpuRun, ended: WorkerExit) -> None:
        # A backend's own failure on the worker's behalf says more than its exit code.
        self.restarts.crash(run, ended.error or f"exit code {ended.code}")

    def refused(self, run: GpuRun, ended: WorkerExit) -> None:
        run.apply(GpuEvent.REFUSED)
        gpu = run.slot.gpu
        self.ending.fail(f"GPU {gpu}: the worker refused its settings or files (exit {ended.code}"
                         + (f": {run.last_error}" if run.last_error else "")
                         + f"); see logs/worker_gpu{gpu}.log", exit_code=2)

    def worker_said(self, run: GpuRun, code: int) -> str:
        """A worker's error without an `error` event: its log's last line, or how it ended."""
        if code < 0:
            return f"killed by signal {-code}"
        path = self.backend().log_file(run.slot.gpu)
        if path is not None:
            try:
                with open(path, "rb") as log:
                    log.seek(max(0, log.seek(0, 2) - 4096))
                    lines = [s.strip() for s in log.read().decode(errors="replace").splitlines()]
            except OSError:
                lines = []
            said = next((s for s in reversed(lines) if s), None)
            if said:
                return said[:300]
        return f"exit code {code}"

    def check_exit(self, run: GpuRun, ended: WorkerExit) -> None:   # NaN or OOM: a failed check
        run.apply(GpuEvent.CHECK_EXIT)
        run.health.exit_code(ended.code)

    def disk_full(self, run: GpuRun, ended: WorkerExit) -> None:
        run.apply(GpuEvent.DISK_FULL)
        self.ending.disk_full(f"GPU {run.slot.gpu}'s worker could not write (exit {ended.code}"
                              + (f": {run.last_error}" if run.last_error else "") + ")")
