"""The judgement of each GPU's last checkpoint after a clean end, for the hub: only passed
checkpoints are pushed, and the checks tick on their own cadence, so without it a run's last
push would carry where they last ticked, not where it ended."""

from __future__ import annotations

import time

from launcher.pod.manifest import event_phase
from launcher.pod.progress import progress
from launcher.supervise.monitor import WorkerMonitor
from launcher.supervise.pod_run import PodRun
from launcher.supervise.pod_view import PodView


class FinalVerdicts:
    def __init__(self, pod: PodRun, monitor: WorkerMonitor, view: PodView):
        self.pod, self.monitor, self.view = pod, monitor, view

    def judge(self, cut_short=lambda: False) -> None:
        """Judge each last checkpoint; `cut_short()` (a second signal) ends the probe wait."""
        pod, last = self.pod, {}
        for gpu, run in pod.runs.items():
            pending = pod.custodian.pending(gpu)
            if run.health is None or run.health.failed() or not pending:
                continue
            run.health.close_out()
            record = last[gpu] = pending[-1]
            if pod.probes is not None:
                pod.probes.probe_final(gpu, record.get("retained") or record["path"],
                                       pod.plan.config.shard_path(gpu, event_phase(record)),
                                       record["sha256"],
                                       record.get("step"))
        if not last:
            return
        if pod.probes is not None and pod.probes.busy():
            self.wait_for_probes(last, cut_short)
        for run in pod.runs.values():
            self.monitor.mark_verified(run)
        pod.events.emit("final_verdicts", stage=pod.stage, verdicts={
            gpu: {"step": r.get("step"), "next_token": r.get("next_token"),
                  **{k: pod.custodian.record_of(gpu, r["sha256"])[k]
                     for k in ("verdict", "reason")}}
            for gpu, r in last.items()})

    def wait_for_probes(self, last: dict[int, dict], cut_short) -> None:
        pod, probes = self.pod, self.pod.probes
        pod.judging_final(True)            # `status` says judging: `stop` waits through it
        self.view.write(force=True)
        largest = max(_size(pod.pod_dir / (r.get("retained") or r["path"]))
                      for r in last.values())
        at_once = probes.widen_for_finish(len(last), largest)
        rounds = -(-len(last) // at_once) + 1       # + the stage's baseline probes
        deadline = time.monotonic() + rounds * probes.schedule.timeout_s
        self.monitor.collect_probes()               # starts the queued probes
        with progress(f"final probes of {len(last)} checkpoint(s)", len(last),
                      "probes") as task:
            while probes.busy() and not cut_short() and time.monotonic() < deadline:
                time.sleep(pod.plan.config.poll_interval_s)
                self.monitor.collect_probes()
                task.update(completed=len(last) - probes.probing(last))
        pod.judging_final(False)
        self.view.write(force=True)


def _size(path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
