"""`RayCustodian`: the checkpoints of a Ray pod, which are on the nodes that wrote them.

Each node retains its GPU's checkpoints, fetches what its worker resumes from, and probes
them (launcher/supervise/ray_node.py). This is the head's side: a checkpoint that passes is
pushed to the hub by the node that holds it (NodePushes, launcher/supervise/ray_pushes.py),
the revisions it pushed are handed to the supervisor (`take_pushed`), a GPU whose node was
lost resumes from its hub copy (`hub_copy`) or its newer recovery copy (`resume_copy`,
launcher/supervise/ray_recovery.py), and AR probes run on the nodes (`NodeProbes`,
launcher/supervise/ray_probes.py). A node that found its entry's recorded bytes nowhere
(BytesNowhere) leaves the way back to the head, which decides it as on one machine before
the restart (`restore`: the GPU's newest passed checkpoint). A push refused because another pod took the run over is
recorded in the run's one lease (`lease`, which the hub sync shares): no node pushes again.

A launch of a pod whose last launcher was killed with -9 resumes each GPU from the recovery
copy of that launcher's last worker start (`resume_newer_copies`, before any worker starts)
when it is newer than the GPU's manifest entry: the node fenced that worker, which saved and
pushed its final save, whose event the dead launcher never read.

It reaches the nodes only through RayBackend's narrow accessor: `actor(gpu)`, `node(gpu)`
and `attempt(gpu)` (the worker start its recovery copies carry), the driver (`ray`), and
`on_lost` (a GPU's node was lost: its queued push is dropped, never sent from the node that
replaces it).
"""

from __future__ import annotations

import time

from launcher.hub.by_url import absolute_hub_url
from launcher.hub.recover import RecoveryError, back_to_passed
from launcher.pod.ckpt_index import FAILED, PASSED, CheckpointIndex
from launcher.pod.decided_rollback import read_decision
from launcher.pod.events import EventLog
from launcher.pod.manifest import Manifest, ManifestEntry, apply_rollback, write_manifest
from launcher.supervise.custodian import NodeCustodian
from launcher.supervise.plan import LaunchPlan
from launcher.supervise.ray_backend import ROUND_TRIP_S, RayBackend, read_lineage
from launcher.supervise.ray_probes import NodeProbes
from launcher.supervise.ray_pushes import NodePushes, newer_recovery_copy

PUSH_WAIT_S = 1800.0       # the last pushes of a run, at its end


class RayCustodian(NodePushes, NodeCustodian):
    def __init__(self, backend: RayBackend):
        super().__init__(backend.pod_dir, backend.config, backend.events)
        self.backend, self.ray, self.hub_url = backend, backend.ray, backend.hub_url
        self.init_pushes()
        backend.on_lost.append(self.forget)
        # At most one round trip to the nodes' pushes every ROUND_TRIP_S, as the backend's.
        self.last_round_trip = float("-inf")

    def forget(self, gpu: int) -> None:
        """GPU `gpu`'s node was lost: its checkpoint not pushed yet is lost with it."""
        self.queued.pop(gpu, None)

    def keep(self, gpu: int, record: dict) -> None:
        self.on_passed(gpu, record)

    def pump(self, force: bool = False) -> None:
        if not force and time.monotonic() - self.last_round_trip < ROUND_TRIP_S:
            return
        self.last_round_trip = time.monotonic()
        self._push_queued()
        self._harvest_pushes(timeout=0)

    def _push_queued(self) -> None:
        if self.lease.taken_over:       # another pod writes the run: what waits stays there
            self.queued.clear()
        super()._push_queued()

    def node_probes(self):
        return NodeProbes(self.backend)

    def restore(self, gpu: int, manifest: Manifest, index: CheckpointIndex) -> bool:
        """Before a restart. The node restores the entry's recorded bytes itself as it starts
        the worker (its own copy, else the entry's hub revision). When its last start found
        them nowhere (BytesNowhere: a damaged newest checkpoint not yet on the hub), the
        launcher decides, as on one machine (launcher/hub/recover.py): the GPU goes back to
        its newest passed checkpoint (the hub's copy of it when pushed, which any node can
        pull; else the node's retained copy), a `rollback` event and the manifest written
        before the lost record is marked failed. A passed checkpoint its node then finds
        nowhere either is marked failed in turn, and the next older one serves. None left:
        RecoveryError, one line (the pod fails)."""
        gone = self.backend.take_bytes_gone(gpu)
        entry = manifest.entries.get(gpu)
        if gone is None or entry is None or entry.checkpoint_sha256 != gone["sha256"]:
            return False
        target = self._newest_passed(gpu, index, gone["sha256"])
        if target is None:
            raise RecoveryError(f"gpu_{gpu} checkpoint {gone['error']}; no passed checkpoint "
                                f"of it is left on its node or the hub either (see "
                                f"logs/checkpoints.jsonl): restore the file")
        back_to_passed(manifest, index, self.events, gpu, f"gpu_{gpu} checkpoint "
                       f"{gone['error']}", target, settle=lambda: write_manifest(manifest))
        return True

    def _newest_passed(self, gpu: int, index: CheckpointIndex, lost: str) -> dict | None:
        """The GPU's newest passed checkpoint other than `lost`: its hub copy when that is
        the one (a hub revision any node pulls), else the record (its node's retained
        copy); the hub copy when the index holds none."""
        hub = self.hub_copy(gpu)
        for record in reversed(index.for_gpu(gpu)):
            if record["verdict"] == PASSED and record["sha256"] != lost:
                return hub if hub and hub["sha256"] == record["sha256"] else record
        return hub if hub and hub["sha256"] != lost else None

    def close(self, abandoned=lambda: False) -> None:
        """The last passed checkpoints go up (a second signal abandons them), before the
        backend's actors go."""
        deadline = time.monotonic() + PUSH_WAIT_S
        self._push_queued()
        while self.pushes and not abandoned() and time.monotonic() < deadline:
            self._harvest_pushes(timeout=0.5)
            self._push_queued()


def resume_newer_copies(plan: LaunchPlan, manifest: Manifest, index: CheckpointIndex,
                        events: EventLog) -> dict[int, ManifestEntry]:
    """At the launch of a Ray pod, before a decided rollback is completed: each GPU whose
    last worker start (the lineage the last launcher recorded, logs/ray_lineage.json) has a
    recovery copy on the hub newer than its manifest entry resumes from that copy, as after
    a node loss (`recovery_copy` event; its node checks it again before the worker starts).
    Never a GPU of a rollback the last launcher decided, a copy marked failed, or another
    start's copy. Returns the entries it replaced, by GPU: each such GPU's node pulls its
    recovery copy, and a failed check rolls it back to the replaced (probed) checkpoint,
    never to that copy (the supervisor's `launch_entries`)."""
    if plan.ray is None or not plan.config.hub:
        return {}
    lineage, hub_url = read_lineage(plan.pod_dir), absolute_hub_url(plan.config.hub,
                                                                   plan.pod_dir)
    decided = set((read_decision(plan.pod_dir) or {}).get("gpus", ()))
    taken = {}
    for gpu in [s.gpu for s in plan.slots if s.gpu in lineage and s.gpu not in decided]:
        entry = manifest.entries.get(gpu)
        copy = newer_recovery_copy(hub_url, plan.pod_dir, plan.config.checkpoint_path(gpu),
                                   gpu, lineage[gpu], entry.position if entry else None,
                                   events, "the manifest's checkpoint")
        if copy is None:
            continue
        known = index.records.get((gpu, copy["sha256"]))
        if known is not None and known["verdict"] == FAILED:
            continue
        was = entry.start_token if entry else None
        taken[gpu] = apply_rollback(manifest, gpu, copy,
                                    (entry.stage if entry else None) or plan.stage)
        manifest.note_hub_revision(gpu, copy["hub_revision"], copy["sha256"])
        events.emit("recovery_copy", gpu=gpu, next_token=copy["next_token"],
                    hub_revision=copy["hub_revision"], node=copy.get("node"),
                    passed_token=was,
                    reason="the last launcher ended before it read this save (its node "
                           "fenced the worker, which saved and pushed it): newer than the "
                           "manifest's checkpoint; checked again on the node before use")
    if taken:
        write_manifest(manifest)
    return taken
