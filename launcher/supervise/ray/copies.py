"""`RayCustodian`: where a Ray pod's checkpoints are, on the nodes that wrote them.

Invariant: a checkpoint goes up from the node that holds it, only the GPU's newest passed
one, never from the node that replaced a lost one, and not at all once another pod took the
run over (the run's lease). A GPU resumes from a recovery copy only of its own lineage.
Owner: RayCustodian, the copies part of CheckpointCustodian.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from launcher.hub import HubError
from launcher.hub.by_url import absolute_hub_url
from launcher.hub.lease import RunTakenOver
from launcher.hub.recover import RecoveryError, back_to_passed
from launcher.hub.redact import describe_error
from launcher.pod.ckpt_index import PASSED, CheckpointIndex
from launcher.pod.decided_rollback import read_decision
from launcher.pod.events import EventLog
from launcher.pod.manifest import (Manifest, ManifestEntry, apply_rollback, event_position,
                                   write_manifest)
from launcher.supervise.custodian import CheckpointCustodian, NodeCopies
from launcher.supervise.plan import LaunchPlan
from launcher.supervise.ray.driver import ROUND_TRIP_S, RayBackend
from launcher.supervise.ray.probes import NodeProbes
from launcher.supervise.ray.recovery import read_recovery_copy
from launcher.supervise.ray.starts import GpuStarts, read_lineage

PUSH_WAIT_S = 1800.0       # the last pushes of a run, at its end


def open_ray(plan: LaunchPlan, events: EventLog) -> tuple[RayBackend, RayCustodian]:
    """A Ray pod's workers and where its checkpoints are, sharing what each start tells."""
    starts = GpuStarts(plan.pod_dir, plan.config, len(plan.slots))
    backend = RayBackend(plan.pod_dir, plan.config, plan.ray, events, starts)
    return backend, RayCustodian(backend, starts)


@dataclass
class _Push:
    ref: object
    record: dict
    node: str | None
    started: float = field(default_factory=time.time)


class RayCustodian(NodeCopies):
    def __init__(self, backend: RayBackend, starts: GpuStarts):
        super().__init__(backend.pod_dir, backend.config, backend.events)
        self.backend, self.starts, self.ray = backend, starts, backend.ray
        self.hub_url = starts.hub_url
        self.queued: dict[int, dict] = {}       # gpu -> newest passed record to push
        self.pushes: dict[int, _Push] = {}
        self.on_hub: dict[int, dict] = {}       # gpu -> newest pushed record + hub_revision
        self.pushed: list[dict] = []            # not yet taken by the custodian
        # A GPU's node was lost: its checkpoint not pushed yet is lost with it.
        backend.on_lost.append(lambda gpu: self.queued.pop(gpu, None))
        self.last_round_trip = float("-inf")    # at most one round trip per ROUND_TRIP_S

    def keep(self, gpu: int, record: dict) -> None:
        if self.hub_url and self.backend.actor(gpu) is not None:
            self.queued[gpu] = record        # only the newest one goes up

    def pump(self, force: bool = False) -> None:
        if not force and time.monotonic() - self.last_round_trip < ROUND_TRIP_S:
            return
        self.last_round_trip = time.monotonic()
        self._push_queued()
        self._harvest_pushes(timeout=0)

    def node_probes(self):
        return NodeProbes(self.backend)

    def _push_queued(self) -> None:
        if self.lease.taken_over:       # another pod writes the run: what waits stays there
            self.queued.clear()
        for gpu in [g for g in self.queued if g not in self.pushes]:
            record = self.queued.pop(gpu)
            actor = self.backend.actor(gpu)
            if actor is None:
                continue
            message = f"fractus-pod node push: gpu{gpu}@{int(record['next_token']):,}"
            ref = actor.push.remote(record["sha256"], self.config.checkpoint_path(gpu), message)
            self.pushes[gpu] = _Push(ref, record, self.backend.node(gpu))

    def _harvest_pushes(self, timeout: float) -> None:
        if not self.pushes:
            return
        refs = [p.ref for p in self.pushes.values()]
        ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=timeout)
        for gpu, push in list(self.pushes.items()):
            if push.ref not in ready:
                continue
            del self.pushes[gpu]
            try:
                revision = self.ray.get(push.ref)
            except Exception as exc:         # the node, the hub: retried with the next pass
                cause = getattr(exc, "cause", None) or exc
                if isinstance(cause, RunTakenOver):   # recorded in the run's lease
                    self.lease.refused(str(cause), "node push")
                    self.queued.clear()     # checkpoints not pushed yet stay on their nodes
                    continue
                self.events.emit("sync_failed", reason="node push", gpu=gpu, node=push.node,
                                 error=describe_error(cause),
                                 seconds=round(time.time() - push.started, 2),
                                 retry="with the GPU's next passed checkpoint")
                continue
            copy = {**push.record, "path": self.config.checkpoint_path(gpu),
                    "hub_revision": revision, "node": push.node}
            self.on_hub[gpu] = copy
            self.pushed.append(copy)

    def take_pushed(self) -> list[dict]:
        pushed, self.pushed = self.pushed, []
        return pushed

    def hub_copy(self, gpu: int) -> dict | None:
        return self.on_hub.get(gpu)

    def resume_copy(self, gpu: int) -> dict | None:
        """A lost node's GPU: the newer of its passed hub copy and its recovery copy."""
        passed = self.hub_copy(gpu)
        attempt = self.starts.attempt(gpu)
        if not self.hub_url or attempt is None:
            return passed
        recovery = newer_recovery_copy(self.hub_url, self.pod_dir,
                                       self.config.checkpoint_path(gpu), gpu, attempt,
                                       event_position(passed) if passed else None,
                                       self.events, "the newest passed copy")
        if recovery is None:
            return passed
        self.events.emit("recovery_copy", gpu=gpu, next_token=recovery["next_token"],
                         hub_revision=recovery["hub_revision"], node=recovery.get("node"),
                         passed_token=passed["next_token"] if passed else None,
                         reason="newer than the newest passed copy: pushed when saved, "
                                "not yet probed; checked again on the node before use")
        return recovery

    def restore(self, gpu: int, manifest: Manifest, index: CheckpointIndex) -> bool:
        """Before a restart: when its last start found its bytes nowhere (BytesNowhere), the
        GPU goes back to its newest passed checkpoint, as on one machine
        (launcher/hub/recover.py). None left: RecoveryError, one line."""
        gone = self.starts.take_bytes_gone(gpu)
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
        """The newest passed checkpoint but `lost`: its hub copy if that one, else its record."""
        hub = self.hub_copy(gpu)
        for record in reversed(index.for_gpu(gpu)):
            if record["verdict"] == PASSED and record["sha256"] != lost:
                return hub if hub and hub["sha256"] == record["sha256"] else record
        return hub if hub and hub["sha256"] != lost else None

    def close(self, abandoned=lambda: False) -> None:
        """The last passed checkpoints go up (a second signal abandons them)."""
        deadline = time.monotonic() + PUSH_WAIT_S
        self._push_queued()
        while self.pushes and not abandoned() and time.monotonic() < deadline:
            self._harvest_pushes(timeout=0.5)
            self._push_queued()


def newer_recovery_copy(hub_url: str, pod_dir, checkpoint: str, gpu: int, attempt: str,
                        than: tuple[int, int] | None, events, serves: str) -> dict | None:
    """The hub's recovery copy of `gpu`'s start `attempt` when past position `than` (None:
    any), else None. Unreadable hub: None and a `recovery_copy_unread` event (`serves`: what
    serves instead)."""
    try:
        copy = read_recovery_copy(hub_url, pod_dir, checkpoint, gpu, attempt)
    except (HubError, OSError, ValueError) as exc:
        events.emit("recovery_copy_unread", gpu=gpu, error=describe_error(exc),
                    reason=f"the hub's recovery copy could not be read: {serves} serves")
        return None
    if copy is None or (than is not None and event_position(copy) <= than):
        return None
    return copy


def resume_newer_copies(plan: LaunchPlan,
                        custodian: CheckpointCustodian) -> dict[int, ManifestEntry]:
    """At launch (a relaunch after kill -9), before a decided rollback is completed: each
    GPU with a recovery copy of its recorded lineage newer than its manifest entry resumes
    from it, as after a node loss; never a GPU of a decided rollback or a copy marked
    failed. Returns the replaced entries by GPU: a failed check goes back to those, never
    to the copy (the custodian's `relaunched_from`)."""
    if plan.ray is None or not plan.config.hub:
        return {}
    manifest, events = custodian.manifest, custodian.events
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
        if custodian.failed(gpu, copy["sha256"]):
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
    custodian.relaunched_from(taken)
    return taken
