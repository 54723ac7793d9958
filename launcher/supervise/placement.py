"""Node loss (a remote backend): a GPU whose machine is gone, disk and all, resumes exactly at
its newest hub copy (its newest passed checkpoint, or on Ray a newer recovery copy:
ray/recovery.py; else where it stood at launch), once a node has a free device for it."""

from __future__ import annotations

from typing import Callable

from launcher.checks.probe_monitor import ProbeMonitor
from launcher.pod.events import EventLog
from launcher.pod.manifest import Manifest, ManifestEntry, apply_rollback, write_manifest
from launcher.supervise.backend import WorkerBackend
from launcher.supervise.custodian import CheckpointCustodian
from launcher.supervise.gpu_run import GpuRun
from launcher.supervise.starter import WorkerStarter
from launcher.supervise.state import GpuEvent


class NodePlacement:
    def __init__(self, manifest: Manifest, events: EventLog, custodian: CheckpointCustodian,
                 stage: Callable[[], int], probes: Callable[[], ProbeMonitor | None],
                 backend: Callable[[], WorkerBackend], starter: WorkerStarter):
        """`stage`, `probes`, `backend`: the pod's as they stand now (they change)."""
        self.manifest, self.events, self.custodian = manifest, events, custodian
        self.stage, self.probes, self.backend = stage, probes, backend
        self.starter = starter

    def on_node_lost(self, run: GpuRun) -> None:
        gpu, events, manifest, custodian = run.slot.gpu, self.events, self.manifest, self.custodian
        stage, probes = self.stage(), self.probes()
        run.apply(GpuEvent.NODE_LOST)
        events.emit("node_lost", gpu=gpu, node=run.node, stage=stage)
        for request in probes.abandon(gpu) if probes is not None else ():
            events.emit("probe_abandoned", gpu=gpu, node=run.node, role=request.role,
                            sha256=request.sha256, reason="its node was lost")
        custodian.fail_pending(gpu, f"lost with node {run.node}")   # never judged; disk gone
        lost = manifest.entries.get(gpu)
        from_token = lost.start_token if lost else None
        target = custodian.resume_copy(gpu)         # the newest trustworthy copy on the hub
        if target is not None:
            apply_rollback(manifest, gpu, target, stage)
            manifest.note_hub_revision(gpu, target["hub_revision"], target["sha256"])
        else:      # where it stood at launch; no entry then: nothing kept, a fresh start
            manifest.reset_entry(gpu, custodian.launch_entries.get(gpu))
        entry = manifest.entries.get(gpu) or ManifestEntry()   # none: token 0, no file
        if entry.checkpoint and not entry.hub_revision:
            run.apply(GpuEvent.GAVE_UP)
            why = (f"node {run.node} was lost and the hub holds no checkpoint of GPU {gpu} "
                   f"to resume from")
            events.emit("gpu_given_up", gpu=gpu, reason=why)
            run.health.fail("node_lost", why)
            return
        write_manifest(manifest)
        events.emit("resume_point", gpu=gpu, from_token=from_token,
                        to_token=entry.start_token, checkpoint=entry.checkpoint,
                        hub_revision=entry.hub_revision, reason="node lost")
        run.announced(False)
        self.place(run)

    def place(self, run: GpuRun) -> None:
        """Start a WAITING GPU once a node has a free device; until then it waits, visibly."""
        if self.backend().can_place(run.slot):
            self.starter.start(run, fresh_health=False)
        elif not run.announced_wait:
            run.announced(True)
            self.events.emit("gpu_waiting", gpu=run.slot.gpu, stage=self.stage(),
                                 reason="no node has a free device; waiting for one to join")
