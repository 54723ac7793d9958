"""What each worker wrote since the last poll, into the pod's records (the supervisor calls it
once per poll): metrics into health checks, checkpoints to the custodian, the manifest and
the probes, passed once the checks (and the probe) vouch for their step. It never starts or
stops a worker."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable

from launcher.checks.criteria import Criteria
from launcher.checks.peers import PeersCheck
from launcher.checks.probe_monitor import ProbeMonitor
from launcher.checks.probe_outcome import apply_outcome
from launcher.config.podconfig import PodConfig
from launcher.pod.events import EventLog
from launcher.pod.manifest import (BackwardsError, Manifest, apply_checkpoint, event_phase,
                                   relative_to_pod, write_manifest)
from launcher.supervise.custodian import CheckpointCustodian
from launcher.supervise.gpu_run import GpuRun

if TYPE_CHECKING:           # tracker_sink imports nothing of the supervisor's at run time
    from launcher.supervise.tracker_sink import TrackerSink


class WorkerMonitor:
    def __init__(self, config: PodConfig, criteria: Criteria, pod_dir: Path, clock,
                 events: EventLog, manifest: Manifest, custodian: CheckpointCustodian,
                 tracker: "TrackerSink | None", runs: Callable[[], dict[int, GpuRun]],
                 stage: Callable[[], int], probes: Callable[[], ProbeMonitor | None]):
        """`runs`, `stage`, `probes`: the pod's as they stand now (they change)."""
        self.config, self.criteria, self.pod_dir, self.clock = config, criteria, pod_dir, clock
        self.events, self.manifest, self.custodian = events, manifest, custodian
        self.tracker, self.runs, self.stage, self.probes = tracker, runs, stage, probes
        self.peers = PeersCheck(criteria.peers)
        self.on_event = {"checkpoint": self.on_checkpoint,
                         "nan": lambda run, record: run.health.event(record),
                         "oom": lambda run, record: run.health.event(record),
                         "error": self.on_error,
                         "done": self.on_done,
                         "start": lambda run, record: self.peers.restart(run.slot.gpu)}

    def listen(self, event: str, handler: Callable[[GpuRun, dict], None]) -> None:
        """`handler(run, record)` for each worker event `event` from now on."""
        self.on_event[event] = handler

    def drain(self, run: GpuRun) -> None:
        for record in run.tail.read():
            if record.get("type") == "metrics":
                run.said_metrics(record, self.clock())
                run.health.feed(record)
                self.peers.feed(run.slot.gpu, record)
                if self.tracker is not None:
                    self.tracker.metrics(run.slot.gpu, record)
                self.mark_verified(run)
            elif record.get("type") == "event" and record.get("event") in self.on_event:
                self.on_event[record["event"]](run, record)

    def judge_peers(self) -> None:
        """Each running GPU against its peers: newly off them, a `gpu_outlier` event and mark
        (or with `action: rollback` a failed check); back, `gpu_outlier_cleared`."""
        runs, events = self.runs(), self.events
        for run in runs.values():
            if run.proc is None:          # only running workers are peers
                self.peers.restart(run.slot.gpu)
        found = {(o.gpu, o.kind): o for o in self.peers.judge()}
        action = self.criteria.peers.action
        for gpu, run in runs.items():
            for kind in [k for k in run.peer_marks if (gpu, k) not in found]:
                del run.peer_marks[kind]
                events.emit("gpu_outlier_cleared", gpu=gpu, kind=kind)
        for (gpu, kind), outlier in found.items():
            run = runs[gpu]
            if kind in run.peer_marks:
                continue                  # one event per incident
            run.peer_marks[kind] = outlier.mark()
            events.emit("gpu_outlier", **outlier.event_fields(), action=action)
            if action == "rollback":
                run.health.fail(f"peers_{kind}", outlier.mark())

    def on_done(self, run: GpuRun, event: dict) -> None:
        run.said_done(str(event.get("reason")),
                      (event_phase(event), event["next_token"])
                      if isinstance(event.get("next_token"), int) else None)

    def on_error(self, run: GpuRun, event: dict) -> None:
        run.said_error(str(event.get("message"))[:300])

    def on_checkpoint(self, run: GpuRun, event: dict) -> None:
        gpu, custodian, stage, probes = run.slot.gpu, self.custodian, self.stage(), self.probes()
        rel = relative_to_pod(event["path"], self.pod_dir)
        record = custodian.record(gpu, event, stage, rel)
        if run.health.failed():
            custodian.fail(gpu, record["sha256"], "written after its GPU failed")
            return
        if event.get("ema_tf") is None:   # stopped before its first step: nothing to resume
            custodian.fail(gpu, record["sha256"], "no training step behind it")
            return
        try:
            changed = apply_checkpoint(self.manifest, gpu, event, stage, self.pod_dir,
                                       self.config.shard_path(gpu, event_phase(event)))
        except BackwardsError as exc:
            self.events.emit("manifest_refused", gpu=gpu, reason=str(exc))
            return
        if changed:
            write_manifest(self.manifest)
        probed = custodian.probe_name(record, event, rel)
        if probes is not None and probed is not None:
            probes.on_checkpoint(gpu, probed,
                                 self.config.shard_path(gpu, event_phase(event)),
                                 record["sha256"], record.get("step"))
        self.mark_verified(run)

    def mark_verified(self, run: GpuRun) -> None:
        custodian, probes = self.custodian, self.probes()
        verified = run.health.verified_step
        if probes is not None and verified is not None:        # the AR probe vouches too
            vouched = probes.vouched_step(run.slot.gpu)
            verified = None if vouched is None else min(verified, vouched)
        if verified is None or (verified, custodian.changes) == run.verified_seen:
            return          # nothing new to judge: the common case, once per metrics line
        run.saw_verified((verified, custodian.changes))
        for record in custodian.pending(run.slot.gpu):
            if record.get("step") is not None and record["step"] <= verified:
                custodian.passed(run.slot.gpu, record["sha256"],
                                 f"checks passed through step {verified} at stage "
                                 f"{self.stage()}")

    def collect_probes(self) -> None:
        probes = self.probes()
        for outcome in probes.poll() if probes is not None else ():
            self.events.emit("probe", stage=self.stage(), **outcome.event_fields())
            run = self.runs()[outcome.request.gpu]
            failed = apply_outcome(outcome, run.health)
            if failed is not None:     # never restored: the probed one and every newer one
                self.custodian.fail_from(run.slot.gpu, outcome.request.sha256,
                                        f"AR probe failed: {failed}")
            self.mark_verified(run)
