"""The monitor: what each worker wrote since the last poll, turned into the pod's records.

Metrics lines feed the GPU's health checks; checkpoint events become checkpoint-index
records and manifest entries (and AR probe requests); a checkpoint is marked passed once the
checks (and the probe, when probes are on) vouch for its step; finished probes are applied;
checkpoints a remote node pushed to the hub are noted in the manifest. It reads and records,
it never starts or stops a worker.
"""

from __future__ import annotations

from launcher.checks.peers import PeersCheck
from launcher.checks.probe_outcome import apply_outcome
from launcher.pod.ckpt_index import FAILED as CK_FAILED
from launcher.pod.ckpt_index import PASSED as CK_PASSED
from launcher.pod.manifest import (BackwardsError, apply_checkpoint, event_phase,
                                   relative_to_pod, write_manifest)
from launcher.supervise.gpu_run import GpuRun
from launcher.supervise.pod_run import PodRun


class WorkerMonitor:
    def __init__(self, pod: PodRun):
        self.pod = pod
        self.peers = PeersCheck(pod.plan.criteria.peers)
        # A worker's own events, each to its one reaction (metrics lines are the common case).
        self.on_event = {"checkpoint": self.on_checkpoint,
                         "nan": lambda run, record: run.health.event(record),
                         "oom": lambda run, record: run.health.event(record),
                         "error": self.on_error,
                         "done": self.on_done,
                         "start": lambda run, record: self.peers.restart(run.slot.gpu)}

    def drain(self, run: GpuRun) -> None:
        for record in run.tail.read():
            if record.get("type") == "metrics":
                run.last_line_at = self.pod.clock()
                run.last_metrics = record
                run.health.feed(record)
                self.peers.feed(run.slot.gpu, record)
                if self.pod.tracker is not None:
                    self.pod.tracker.metrics(run.slot.gpu, record)
                self.mark_verified(run)
            elif record.get("type") == "event" and record.get("event") in self.on_event:
                self.on_event[record["event"]](run, record)

    def judge_peers(self) -> None:
        """Each running GPU against its peers: a GPU newly off them gets its `gpu_outlier`
        event (the alert) and a status mark, or with `action: rollback` fails its checks;
        one back with them loses the mark (`gpu_outlier_cleared`)."""
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
        run.done_reason = str(event.get("reason"))
        if isinstance(event.get("next_token"), int):
            run.done_at = (event_phase(event), event["next_token"])

    def on_error(self, run: GpuRun, event: dict) -> None:
        run.last_error, run.error_reported = str(event.get("message"))[:300], True

    def on_checkpoint(self, run: GpuRun, event: dict) -> None:
        pod, gpu = self.pod, run.slot.gpu
        rel = relative_to_pod(event["path"], pod.pod_dir)
        record = pod.index.add(gpu, event, pod.stage, rel)
        if run.health.failed():
            pod.index.mark(gpu, record["sha256"], CK_FAILED, "written after its GPU failed")
            return
        if event.get("ema_tf") is None:   # stopped before its first step: nothing to resume
            pod.index.mark(gpu, record["sha256"], CK_FAILED, "no training step behind it")
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
        if verified is None or (verified, pod.index.size) == run.verified_seen:
            return          # nothing new to judge: the common case, once per metrics line
        run.verified_seen = (verified, pod.index.size)
        for record in pod.index.pending(run.slot.gpu):
            if record.get("step") is not None and record["step"] <= verified:
                passed = pod.index.mark(run.slot.gpu, record["sha256"], CK_PASSED,
                                        f"checks passed through step {verified} at stage "
                                        f"{pod.stage}")
                pod.custodian.passed(run.slot.gpu, passed)

    def collect_probes(self) -> None:
        pod = self.pod
        for outcome in pod.probes.poll() if pod.probes is not None else ():
            pod.events.emit("probe", stage=pod.stage, **outcome.event_fields())
            run = pod.runs[outcome.request.gpu]
            apply_outcome(outcome, run.health, pod.index)
            self.mark_verified(run)

    def note_pushed(self) -> None:
        """A node pushed a passed checkpoint: the manifest notes its hub revision where the
        entry still names those bytes (as launcher/hub/sync.py does for the launcher's pushes)."""
        pod, noted = self.pod, []
        for copy in pod.custodian.take_pushed():
            gpu = copy["gpu"]
            if pod.manifest.note_hub_revision(gpu, copy["hub_revision"], copy["sha256"]):
                noted.append(gpu)
            pod.events.emit("sync_pushed", reason="node", gpu=gpu, node=copy.get("node"),
                            revision=copy["hub_revision"],
                            tokens={gpu: int(copy["next_token"])}, files=1,
                            hub_revision_for=[gpu] if gpu in noted else [])
        if noted:
            write_manifest(pod.manifest)

