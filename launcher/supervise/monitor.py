"""What each worker wrote since the last poll, into the pod's records (the supervisor calls it
once per poll): metrics into health checks, checkpoints to the custodian, the manifest and
the probes, passed once the checks (and the probe) vouch for their step. It never starts or
stops a worker."""

from __future__ import annotations

from launcher.checks.peers import PeersCheck
from launcher.checks.probe_outcome import apply_outcome
from launcher.pod.manifest import (BackwardsError, apply_checkpoint, event_phase,
                                   relative_to_pod, write_manifest)
from launcher.supervise.gpu_run import GpuRun
from launcher.supervise.pod_run import PodRun


class WorkerMonitor:
    def __init__(self, pod: PodRun):
        self.pod = pod
        self.peers = PeersCheck(pod.plan.criteria.peers)
        self.on_event = {"checkpoint": self.on_checkpoint,
                         "nan": lambda run, record: run.health.event(record),
                         "oom": lambda run, record: run.health.event(record),
                         "error": self.on_error,
                         "done": self.on_done,
                         "start": lambda run, record: self.peers.restart(run.slot.gpu)}

    def drain(self, run: GpuRun) -> None:
        for record in run.tail.read():
            if record.get("type") == "metrics":
                run.said_metrics(record, self.pod.clock())
                run.health.feed(record)
                self.peers.feed(run.slot.gpu, record)
                if self.pod.tracker is not None:
                    self.pod.tracker.metrics(run.slot.gpu, record)
                self.mark_verified(run)
            elif record.get("type") == "event" and record.get("event") in self.on_event:
                self.on_event[record["event"]](run, record)

    def judge_peers(self) -> None:
        """Each running GPU against its peers: newly off them, a `gpu_outlier` event and mark
        (or with `action: rollback` a failed check); back, `gpu_outlier_cleared`."""
        pod = self.pod
        for run in pod.runs.values():
            if run.proc is None:          # only running workers are peers
                self.peers.restart(run.slot.gpu)
        found = {(o.gpu, o.kind): o for o in self.peers.judge()}
        action = pod.plan.criteria.peers.action
        for gpu, run in pod.runs.items():
            for kind in [k for k in run.peer_marks if (gpu, k) not in found]:
                del run.peer_marks[kind]
                pod.events.emit("gpu_outlier_cleared", gpu=gpu, kind=kind)
        for (gpu, kind), outlier in found.items():
            run = pod.runs[gpu]
            if kind in run.peer_marks:
                continue                  # one event per incident
            run.peer_marks[kind] = outlier.mark()
            pod.events.emit("gpu_outlier", **outlier.event_fields(), action=action)
            if action == "rollback":
                run.health.fail(f"peers_{kind}", outlier.mark())

    def on_done(self, run: GpuRun, event: dict) -> None:
        run.said_done(str(event.get("reason")),
                      (event_phase(event), event["next_token"])
                      if isinstance(event.get("next_token"), int) else None)

    def on_error(self, run: GpuRun, event: dict) -> None:
        run.said_error(str(event.get("message"))[:300])

    def on_checkpoint(self, run: GpuRun, event: dict) -> None:
        pod, gpu = self.pod, run.slot.gpu
        rel = relative_to_pod(event["path"], pod.pod_dir)
        record = pod.custodian.record(gpu, event, pod.stage, rel)
        if run.health.failed():
            pod.custodian.fail(gpu, record["sha256"], "written after its GPU failed")
            return
        if event.get("ema_tf") is None:   # stopped before its first step: nothing to resume
            pod.custodian.fail(gpu, record["sha256"], "no training step behind it")
            return
        try:
            changed = apply_checkpoint(pod.manifest, gpu, event, pod.stage, pod.pod_dir,
                                       pod.plan.config.shard_path(gpu, event_phase(event)))
        except BackwardsError as exc:
            pod.events.emit("manifest_refused", gpu=gpu, reason=str(exc))
            return
        if changed:
            write_manifest(pod.manifest)
        probed = pod.custodian.probe_name(record, event, rel)
        if pod.probes is not None and probed is not None:
            pod.probes.on_checkpoint(gpu, probed,
                                     pod.plan.config.shard_path(gpu, event_phase(event)),
                                     record["sha256"], record.get("step"))
        self.mark_verified(run)

    def mark_verified(self, run: GpuRun) -> None:
        pod = self.pod
        verified = run.health.verified_step
        if pod.probes is not None and verified is not None:    # the AR probe vouches too
            vouched = pod.probes.vouched_step(run.slot.gpu)
            verified = None if vouched is None else min(verified, vouched)
        if verified is None or (verified, pod.custodian.changes) == run.verified_seen:
            return          # nothing new to judge: the common case, once per metrics line
        run.saw_verified((verified, pod.custodian.changes))
        for record in pod.custodian.pending(run.slot.gpu):
            if record.get("step") is not None and record["step"] <= verified:
                pod.custodian.passed(run.slot.gpu, record["sha256"],
                                     f"checks passed through step {verified} at stage "
                                     f"{pod.stage}")

    def collect_probes(self) -> None:
        pod = self.pod
        for outcome in pod.probes.poll() if pod.probes is not None else ():
            pod.events.emit("probe", stage=pod.stage, **outcome.event_fields())
            run = pod.runs[outcome.request.gpu]
            failed = apply_outcome(outcome, run.health)
            if failed is not None:     # never restored: the probed one and every newer one
                pod.custodian.fail_from(run.slot.gpu, outcome.request.sha256,
                                        f"AR probe failed: {failed}")
            self.mark_verified(run)
