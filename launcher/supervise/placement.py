"""Node loss (a remote backend): a GPU whose machine is gone, disk and all, resumes exactly at
its newest hub copy (its newest passed checkpoint, or on Ray a newer recovery copy:
ray/recovery.py; else where it stood at launch), once a node has a free device for it."""

from __future__ import annotations

from launcher.pod.manifest import ManifestEntry, apply_rollback, write_manifest
from launcher.supervise.gpu_run import GpuRun
from launcher.supervise.pod_run import PodRun
from launcher.supervise.starter import WorkerStarter
from launcher.supervise.state import GpuEvent


class NodePlacement:
    def __init__(self, pod: PodRun, starter: WorkerStarter):
        self.pod, self.starter = pod, starter

    def on_node_lost(self, run: GpuRun) -> None:
        pod, gpu = self.pod, run.slot.gpu
        run.apply(GpuEvent.NODE_LOST)
        pod.events.emit("node_lost", gpu=gpu, node=run.node, stage=pod.stage)
        for request in pod.probes.abandon(gpu) if pod.probes is not None else ():
            pod.events.emit("probe_abandoned", gpu=gpu, node=run.node, role=request.role,
                            sha256=request.sha256, reason="its node was lost")
        pod.custodian.fail_pending(gpu, f"lost with node {run.node}")   # never judged; disk gone
        lost = pod.manifest.entries.get(gpu)
        from_token = lost.start_token if lost else None
        target = pod.custodian.resume_copy(gpu)     # the newest trustworthy copy on the hub
        if target is not None:
            apply_rollback(pod.manifest, gpu, target, pod.stage)
            pod.manifest.note_hub_revision(gpu, target["hub_revision"], target["sha256"])
        else:      # where it stood at launch; no entry then: nothing kept, a fresh start
            pod.manifest.reset_entry(gpu, pod.custodian.launch_entries.get(gpu))
        entry = pod.manifest.entries.get(gpu) or ManifestEntry()   # none: token 0, no file
        if entry.checkpoint and not entry.hub_revision:
            run.apply(GpuEvent.GAVE_UP)
            why = (f"node {run.node} was lost and the hub holds no checkpoint of GPU {gpu} "
                   f"to resume from")
            pod.events.emit("gpu_given_up", gpu=gpu, reason=why)
            run.health.fail("node_lost", why)
            return
        write_manifest(pod.manifest)
        pod.events.emit("resume_point", gpu=gpu, from_token=from_token,
                        to_token=entry.start_token, checkpoint=entry.checkpoint,
                        hub_revision=entry.hub_revision, reason="node lost")
        run.announced(False)
        self.place(run)

    def place(self, run: GpuRun) -> None:
        """Start a WAITING GPU once a node has a free device; until then it waits, visibly."""
        if self.pod.backend.can_place(run.slot):
            self.starter.start(run, fresh_health=False)
        elif not run.announced_wait:
            run.announced(True)
            self.pod.events.emit("gpu_waiting", gpu=run.slot.gpu, stage=self.pod.stage,
                                 reason="no node has a free device; waiting for one to join")
