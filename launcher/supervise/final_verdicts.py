"""The judgement of each GPU's last checkpoint after a clean end, for the hub: only passed
checkpoints are pushed, and the checks tick on their own cadence, so without it a run's last
push would carry where they last ticked, not where it ended."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from launcher.checks.probe_monitor import ProbeMonitor
from launcher.config.podconfig import PodConfig
from launcher.pod.events import EventLog
from launcher.pod.manifest import event_phase
from launcher.pod.progress import progress
from launcher.supervise.custodian import CheckpointCustodian
from launcher.supervise.gpu_run import GpuRun
from launcher.supervise.monitor import WorkerMonitor
from launcher.supervise.pod_view import PodView


class FinalVerdicts:
    def __init__(self, config: PodConfig, pod_dir: Path, events: EventLog,
                 custodian: CheckpointCustodian, runs: Callable[[], dict[int, GpuRun]],
                 probes: Callable[[], ProbeMonitor | None], stage: Callable[[], int],
                 judging: Callable[[bool], None], monitor: WorkerMonitor, view: PodView):
        """`runs`, `probes`, `stage`: the pod's as they stand now (they change); `judging`
        tells the pod its final probes run (True) or ended (False)."""
        self.config, self.pod_dir, self.events, self.custodian = config, pod_dir, events, custodian
        self.runs, self.probes, self.stage, self.judging = runs, probes, stage, judging
        self.monitor, self.view = monitor, view

    def judge(self, cut_short=lambda: False) -> None:
        """Judge each last checkpoint; `cut_short()` (a second signal) ends the probe wait."""
        last, custodian, probes = {}, self.custodian, self.probes()
        for gpu, run in self.runs().items():
            pending = custodian.pending(gpu)
            if run.health is None or run.health.failed() or not pending:
                continue
            run.health.close_out()
            record = last[gpu] = pending[-1]
            if probes is not None:
                probes.probe_final(gpu, record.get("retained") or record["path"],
                                   self.config.shard_path(gpu, event_phase(record)),
                                   record["sha256"],
                                   record.get("step"))
        if not last:
            return
        if probes is not None and probes.busy():
            self.wait_for_probes(last, cut_short)
        for run in self.runs().values():
            self.monitor.mark_verified(run)
        self.events.emit("final_verdicts", stage=self.stage(), verdicts={
            gpu: {"step": r.get("step"), "next_token": r.get("next_token"),
                  **{k: custodian.record_of(gpu, r["sha256"])[k]
                     for k in ("verdict", "reason")}}
            for gpu, r in last.items()})

    def wait_for_probes(self, last: dict[int, dict], cut_short) -> None:
        probes = self.probes()
        self.judging(True)                 # `status` says judging: `stop` waits through it
        self.view.write(force=True)
        largest = max(_size(self.pod_dir / (r.get("retained") or r["path"]))
                      for r in last.values())
        at_once = probes.widen_for_finish(len(last), largest)
        rounds = -(-len(last) // at_once) + 1       # + the stage's baseline probes
        deadline = time.monotonic() + rounds * probes.schedule.timeout_s
        self.monitor.collect_probes()               # starts the queued probes
        with progress(f"final probes of {len(last)} checkpoint(s)", len(last),
                      "probes") as task:
            while probes.busy() and not cut_short() and time.monotonic() < deadline:
                time.sleep(self.config.poll_interval_s)
                self.monitor.collect_probes()
                task.update(completed=len(last) - probes.probing(last))
        self.judging(False)
        self.view.write(force=True)


def _size(path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
