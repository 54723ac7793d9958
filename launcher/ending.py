"""How a pod run ends, part of the Supervisor (launcher/supervisor.py): a graceful stop, a
FAILED pod, and the final judgement of each GPU's last checkpoint after a clean end.

The final judgement exists for the hub: a sync pushes only checkpoints that passed their
checks, and the periodic checks and AR probes tick on their own cadence, so without it the
last push of a run would carry where the checks last ticked, not where the run ended.
"""

from __future__ import annotations

import time

from launcher.ckpt_index import FAILED as CK_FAILED
from launcher.gpu_run import STOPPED
from launcher.health import FAILED
from launcher.progress import progress
from launcher.workers import kill, terminate


class PodEnding:
    """Mixed into Supervisor; uses its runs, index, events, probes and plan."""

    def _stop_workers(self, kill_gpus: set[int]) -> None:
        for run in self.runs.values():
            if run.proc is not None and run.slot.gpu in kill_gpus:
                kill(run.proc)
        terminate([r.proc for r in self.runs.values() if r.proc is not None],
                  self.plan.config.stop_grace_s)
        for run in self.runs.values():
            self._drain(run)
            if run.proc is not None:
                self.events.emit("worker_exit", gpu=run.slot.gpu, code=run.proc.returncode,
                                 stage=self.stage)
            run.proc, run.state = None, STOPPED

    def _fail_pod(self, reason: str, exit_code: int) -> None:
        self.pod_state, self.reason = "failing", reason
        failed = {r.slot.gpu for r in self.runs.values()
                  if r.health and r.health.phase() == FAILED}
        self._stop_workers(kill_gpus=failed)
        for gpu in failed:
            for record in self.index.pending(gpu):
                self.index.mark(gpu, record["sha256"], CK_FAILED, "its GPU failed")
        self.events.emit("pod_failed", stage=self.stage, reason=reason)
        self.pod_state, self.exit_code = "failed", exit_code

    def _stop(self, reason: str) -> None:
        self.pod_state, self.reason = "stopping", reason
        self._write_state(force=True)
        self._stop_workers(kill_gpus=set())
        self.events.emit("pod_stopped", stage=self.stage, reason=reason)
        self.pod_state = "stopped"

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
        for run in self.runs.values():
            self._mark_verified(run)
        self.events.emit("final_verdicts", stage=self.stage, verdicts={
            gpu: {"step": r.get("step"), "next_token": r.get("next_token"),
                  **{k: self.index.records[(gpu, r["sha256"])][k] for k in ("verdict", "reason")}}
            for gpu, r in last.items()})


def _size(path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
