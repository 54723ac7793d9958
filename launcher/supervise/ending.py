"""How a pod run ends, part of the Supervisor (launcher/supervise/supervisor.py): a graceful stop, a
FAILED pod (a full disk among the causes), and the final judgement of each GPU's last
checkpoint after a clean end.

The final judgement exists for the hub: a sync pushes only checkpoints that passed their
checks, and the periodic checks and AR probes tick on their own cadence, so without it the
last push of a run would carry where the checks last ticked, not where the run ended.
"""

from __future__ import annotations

import sys
import time

from fractus.train.disk import disk_full
from launcher.pod.ckpt_index import FAILED as CK_FAILED
from launcher.pod.failed_resume import restore_passed
from launcher.checks.health import FAILED
from launcher.pod.manifest import write_manifest
from launcher.pod.progress import progress
from launcher.supervise.state import GpuEvent, PodEvent, PodState


class PodEnding:
    """Mixed into Supervisor; uses its runs, index, events, probes, plan and backend."""

    def _stop_workers(self, kill_gpus: set[int]) -> None:
        exits = {}
        for run in self.runs.values():
            if run.proc is not None and run.slot.gpu in kill_gpus:
                exits[run.slot.gpu] = self.backend.kill(run.proc)
        exits.update(self.backend.stop(
            [r.proc for r in self.runs.values()
             if r.proc is not None and r.slot.gpu not in kill_gpus],
            self.plan.config.stop_grace_s))
        self.backend.pump(force=True)      # the last lines a remote worker wrote
        for run in self.runs.values():
            self._drain(run)
            if run.proc is not None:
                self.events.emit("worker_exit", gpu=run.slot.gpu,
                                 code=exits[run.slot.gpu].code, stage=self.stage)
            run.proc = None
            run.apply(GpuEvent.STOPPED)

    def _fail_pod(self, reason: str, exit_code: int) -> None:
        self._pod(PodEvent.FAIL)
        self.reason = reason
        failed = {r.slot.gpu for r in self.runs.values()
                  if r.health and r.health.phase() == FAILED}
        self._stop_workers(kill_gpus=failed)
        for gpu in failed:
            for record in self.index.pending(gpu):
                self.index.mark(gpu, record["sha256"], CK_FAILED, "its GPU failed")
        # The manifest must not name what was just marked failed: the user's own relaunch
        # reads it too (the next launch checks again: launcher/pod/failed_resume.py).
        if restore_passed(self.manifest, self.index, self.events, list(self.runs),
                          refuse=False):
            write_manifest(self.manifest)
        self.events.emit("pod_failed", stage=self.stage, reason=reason)
        self._pod(PodEvent.FAILED)
        self.exit_code = exit_code

    def _on_write_error(self, exc: OSError) -> None:
        """One of the launcher's own writes failed. A full disk fails the pod, recorded
        with the space the reserve frees; anything else is a bug and propagates."""
        if disk_full(exc) is None:
            raise exc
        self._disk_full(f"the launcher could not write ({exc.strerror})")

    def _disk_full(self, what: str) -> None:
        """The disk is full (a worker's or the launcher's own write failed): nothing can
        make progress. Workers stop (each checkpoints if it still can; saves are atomic,
        so the last checkpoint stays valid), the reserve is freed, and the failure is
        recorded where people look: the pod_failed event and `status`."""
        if self.pod_state in (PodState.FAILING, PodState.FAILED):
            return
        reason = f"disk full: {what}; free space on {self.pod_dir}, then launch again"
        self.backend.stop([r.proc for r in self.runs.values() if r.proc is not None],
                          self.plan.config.stop_grace_s)
        if self.reserve is not None:
            self.reserve.release()
        try:
            self._fail_pod(reason, exit_code=1)
        except OSError as exc:         # not even the reserve's space was enough
            self._pod(PodEvent.FAILED)           # _fail_pod made it FAILING first
            self.reason, self.exit_code = reason, 1
            for run in self.runs.values():
                run.proc = None
                run.apply(GpuEvent.STOPPED)
            warn(f"{reason} (not recorded: {exc.strerror})")
        self._write_state(force=True)

    def _stop(self, reason: str) -> None:
        self._pod(PodEvent.STOP)
        self.reason = reason
        self._write_state(force=True)
        self._stop_workers(kill_gpus=set())
        self.events.emit("pod_stopped", stage=self.stage, reason=reason)
        self._pod(PodEvent.STOPPED)

    def _judge_final(self) -> None:
        """A clean end (stop, --max-time, --max-steps, end of shard): judge each GPU's last
        checkpoint now (the periodic checks closed out on its final metrics line, and an AR
        probe of it when probes are on), so the final push carries the run where it ended
        instead of where the checks last ticked. A second signal cuts this short."""
        last = {}
        for gpu, run in self.runs.items():
            pending = self.index.pending(gpu)
            if run.health is None or run.health.failed() or not pending:
                continue
            run.health.close_out()
            record = last[gpu] = pending[-1]
            if self.probes is not None:
                self.probes.probe_final(gpu, record.get("retained") or record["path"],
                                        self.plan.config.shard_path(gpu), record["sha256"],
                                        record.get("step"))
        if not last:
            return
        if self.probes is not None and self.probes.busy():
            ended_as, self.pod_state = self.pod_state, "judging"    # `stop` waits through it
            self._write_state(force=True)
            largest = max(_size(self.pod_dir / (r.get("retained") or r["path"]))
                          for r in last.values())
            at_once = self.probes.widen_for_finish(len(last), largest)
            rounds = -(-len(last) // at_once) + 1       # + the stage's baseline probes
            deadline = time.monotonic() + rounds * self.probes.schedule.timeout_s
            self._collect_probes()                      # starts the queued probes
            with progress(f"final probes of {len(last)} checkpoint(s)", len(last),
                          "probes") as task:
                while self.probes.busy() and not self.cut_short and time.monotonic() < deadline:
                    time.sleep(self.plan.config.poll_interval_s)
                    self._collect_probes()
                    task.update(completed=len(last) - self.probes.probing(last))
            self.pod_state = ended_as
            self._write_state(force=True)
        for run in self.runs.values():
            self._mark_verified(run)
        self.events.emit("final_verdicts", stage=self.stage, verdicts={
            gpu: {"step": r.get("step"), "next_token": r.get("next_token"),
                  **{k: self.index.records[(gpu, r["sha256"])][k] for k in ("verdict", "reason")}}
            for gpu, r in last.items()})


def warn(message: str) -> None:
    """A line on the launcher's stderr, which may itself be a log on the full disk."""
    try:
        print(f"fractus-pod: {message}", file=sys.stderr, flush=True)
    except OSError:
        pass


def _size(path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
