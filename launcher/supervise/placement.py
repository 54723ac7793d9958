"""Node loss and placement (a remote backend): a GPU whose machine is gone, with its disk,
resumes from its newest passed checkpoint on the hub (else where it stood at launch),
exactly at that checkpoint's tokens, once a node has a free device for it; until then it
waits, visibly."""

from __future__ import annotations

from launcher.pod.ckpt_index import FAILED as CK_FAILED
from launcher.pod.manifest import apply_rollback, write_manifest
from launcher.supervise.gpu_run import GpuRun
from launcher.supervise.pod_run import PodRun
from launcher.supervise.starter import WorkerStarter
from launcher.supervise.state import GpuEvent


class NodePlacement:
    def __init__(self, pod: PodRun, starter: WorkerStarter):
        self.pod, self.starter = pod, starter
        # Where each GPU stood at launch: its resume point after a lost node when the hub
        # holds nothing newer of it.
        self.launch_entries = {g: dict(e) for g, e in pod.manifest.entries.items()}

    def on_node_lost(self, run: GpuRun) -> None:
        pod, gpu = self.pod, run.slot.gpu
        run.apply(GpuEvent.NODE_LOST)
        pod.events.emit("node_lost", gpu=gpu, node=run.node, stage=pod.stage)
        for request in pod.probes.abandon(gpu) if pod.probes is not None else ():
            pod.events.emit("probe_abandoned", gpu=gpu, node=run.node, role=request.role,
                            sha256=request.sha256, reason="its node was lost")
        for record in pod.index.pending(gpu):     # never judged; their disk is gone
            pod.index.mark(gpu, record["sha256"], CK_FAILED, f"lost with node {run.node}")
        from_token = pod.manifest.entries.get(gpu, {}).get("start_token")
        target = pod.backend.hub_copy(gpu)
        if target is not None:
            apply_rollback(pod.manifest, gpu, target, pod.stage)
            pod.manifest.entries[gpu]["hub_revision"] = target["hub_revision"]
        elif self.launch_entries.get(gpu):
            pod.manifest.entries[gpu] = dict(self.launch_entries[gpu])
        else:
            pod.manifest.entries.pop(gpu, None)    # nothing kept anywhere: a fresh start
        entry = pod.manifest.entries.get(gpu) or {}
        if entry.get("checkpoint") and not entry.get("hub_revision"):
            run.apply(GpuEvent.GAVE_UP)
            run.health.fail("node_lost", f"node {run.node} was lost and the hub holds no "
                                         f"checkpoint of GPU {gpu} to resume from")
            return
        write_manifest(pod.manifest)
        pod.events.emit("resume_point", gpu=gpu, from_token=from_token,
                        to_token=entry.get("start_token", 0),
                        checkpoint=entry.get("checkpoint"),
                        hub_revision=entry.get("hub_revision"), reason="node lost")
        run.announced_wait = False
        self.place(run)

    def place(self, run: GpuRun) -> None:
        """Start a WAITING GPU once a node has a free device; until then it waits, visibly."""
        if self.pod.backend.can_place(run.slot):
            self.starter.start(run, fresh_health=False)
        elif not run.announced_wait:
            run.announced_wait = True
            self.pod.events.emit("gpu_waiting", gpu=run.slot.gpu, stage=self.pod.stage,
                                 reason="no node has a free device; waiting for one to join")
