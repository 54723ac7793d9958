"""How a pod run ends: a graceful stop (a signal, `stop`, --max-time), a FAILED pod (a full
disk among the causes), and stopping the workers for either or for a rollback."""

from __future__ import annotations

from fractus.train.disk import no_space_error
from launcher.checks.health import FAILED
from launcher.errors import warn
from launcher.files import dir_id
from launcher.pod.reserve import DiskReserve
from launcher.supervise.monitor import WorkerMonitor
from launcher.supervise.pod_run import PodRun
from launcher.supervise.pod_view import PodView
from launcher.supervise.state import PodEvent, PodState

LOGS_MOVED = "logs/ was moved, replaced or deleted while the pod ran"


class PodEnding:
    """Keeps the whole PodRun: it moves the pod's state (stop, fail), its runs and files."""

    def __init__(self, pod: PodRun, monitor: WorkerMonitor, view: PodView):
        self.pod, self.monitor, self.view = pod, monitor, view
        self.reserve: DiskReserve | None = None    # made by `begin`: it writes a file

    def begin(self) -> None:
        """The run begins: the disk reserve a full disk's failure is recorded with."""
        self.reserve = DiskReserve(self.pod.pod_dir)

    def stop_workers(self, kill_gpus: set[int]) -> None:
        """Kill `kill_gpus`' workers, stop the others gracefully, read their last lines."""
        pod, exits = self.pod, {}
        for run in pod.runs.values():
            if run.proc is not None and run.slot.gpu in kill_gpus:
                exits[run.slot.gpu] = pod.backend.kill(run.proc)
        exits.update(pod.backend.stop(
            [r.proc for r in pod.runs.values()
             if r.proc is not None and r.slot.gpu not in kill_gpus],
            pod.plan.config.stop_grace_s))
        pod.backend.pump(force=True)      # the last lines a remote worker wrote
        for run in pod.runs.values():
            self.monitor.drain(run)
            if run.proc is not None:
                pod.events.emit("worker_exit", gpu=run.slot.gpu,
                                code=exits[run.slot.gpu].code, stage=pod.stage)
            run.stopped()

    def stop(self, reason: str) -> None:
        pod = self.pod
        pod.move(PodEvent.STOP, reason=reason)
        self.view.write(force=True)
        self.stop_workers(kill_gpus=set())
        pod.events.emit("pod_stopped", stage=pod.stage, reason=reason)
        pod.move(PodEvent.STOPPED)

    def fail(self, reason: str, exit_code: int) -> None:
        pod = self.pod
        pod.move(PodEvent.FAIL, reason=reason)
        failed = {r.slot.gpu for r in pod.runs.values()
                  if r.health and r.health.phase() == FAILED}
        self.stop_workers(kill_gpus=failed)
        for gpu in failed:
            pod.custodian.fail_pending(gpu, "its GPU failed")
        # The manifest must not name what was just marked failed: the user's own relaunch
        # reads it too.
        pod.custodian.restore_passed(list(pod.runs))
        pod.events.emit("pod_failed", stage=pod.stage, reason=reason)
        pod.move(PodEvent.FAILED, exit_code=exit_code)

    def on_write_error(self, exc: OSError) -> None:
        """A launcher read or write failed: a full disk, or a pod file gone or replaced,
        fails the pod in one line; anything else is a bug and propagates."""
        if isinstance(exc, (FileNotFoundError, IsADirectoryError, NotADirectoryError)):
            logs_id = self.pod.logs_id
            if logs_id is not None and dir_id(self.pod.pod_dir / "logs") != logs_id:
                # logs/ itself moved between the loop's check and this read: say so
                self.files_lost(LOGS_MOVED, logs_id)
                return
            self.files_lost(f"a pod file went away or was replaced while the pod ran "
                            f"({exc.strerror}: {exc.filename})", self.pod.logs_id,
                            fix=f"move away what stands at {exc.filename} now (and put "
                                f"the file back there if you have it)")
            return
        if no_space_error(exc) is None:
            raise exc
        self.disk_full(f"the launcher could not write ({exc.strerror})")

    def files_lost(self, what: str, logs_id: tuple | None = None,
                   fix: str = "put logs/ back (e.g. `mv logs.moved logs`)") -> None:
        """The pod's files went away under the launcher: stop the workers gracefully, FAIL in
        one line (`fix`: what puts them back), recorded only into the original logs/
        (`logs_id`, see dir_id). Never recreate logs/: the workers still write into the
        moved one, and an empty new one would make healthy workers look hung."""
        pod = self.pod
        if pod.state in (PodState.FAILING, PodState.FAILED):
            return
        reason = (f"{what}; the workers were stopped (each checkpointed): {fix}, then "
                  f"launch again")
        pod.lost_files()
        self._stop_all()
        for run in pod.runs.values():
            run.stopped()
        pod.move(PodEvent.FAIL, reason=reason)
        pod.move(PodEvent.FAILED, exit_code=1)
        try:       # into the pod's own logs/ only: a new empty one would be in the way
            if logs_id is None or dir_id(pod.events.path.parent) == logs_id:
                pod.events.emit("pod_failed", stage=pod.stage, reason=reason)
        except OSError:
            pass

    def _stop_all(self) -> None:
        """Every worker stopped gracefully (each checkpoints), the disk reserve freed."""
        self.pod.backend.stop([r.proc for r in self.pod.runs.values() if r.proc is not None],
                              self.pod.plan.config.stop_grace_s)
        if self.reserve is not None:
            self.reserve.release()

    def disk_full(self, what: str) -> None:
        """The disk is full: workers stop (saves are atomic: the last checkpoint stays
        valid), the reserve is freed to record pod_failed, the pod FAILED."""
        pod = self.pod
        if pod.state in (PodState.FAILING, PodState.FAILED):
            return
        reason = f"disk full: {what}; free space on {pod.pod_dir}, then launch again"
        self._stop_all()
        try:
            self.fail(reason, exit_code=1)
        except OSError as exc:         # not even the reserve's space was enough
            pod.move(PodEvent.FAILED, reason=reason, exit_code=1)  # fail() made it FAILING
            for run in pod.runs.values():
                run.stopped()
            warn(f"{reason} (not recorded: {exc.strerror})")
        self.view.write(force=True)
