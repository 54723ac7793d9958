"""The hub side of a Ray pod: a checkpoint that passes is pushed by the node that holds it.

`RayCustodian` (launcher/supervise/ray_custodian.py) queues each GPU's newest passed checkpoint
(`on_passed`: only the newest goes up), asks that GPU's actor to push it, harvests the
revisions once per poll, and hands them to the supervisor (`take_pushed`), which records
them in the manifest; `resume_copy` is what a GPU whose node was lost resumes from: its
passed `hub_copy`, or the recovery copy of its lost worker when newer
(launcher/supervise/ray_recovery.py). A push refused because another pod took the run over
stops every node's pushes (the run's lease, `RunLease` in launcher/hub/sync.py, shared with
the hub sync; launcher/hub/lease.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from launcher.hub.lease import RunTakenOver
from launcher.hub.redact import describe_error
from launcher.hub import HubError
from launcher.pod.manifest import event_position
from launcher.supervise.ray_recovery import read_recovery_copy


@dataclass
class _Push:
    ref: object
    record: dict
    node: str | None
    started: float = field(default_factory=time.time)


class NodePushes:
    """Mixed into RayCustodian, which provides `backend` (its `actor(gpu)`, `node(gpu)` and
    `attempt(gpu)`), `lease`, `config`, `events`, `ray`, `hub_url` and `pod_dir`."""

    def init_pushes(self) -> None:
        self.queued: dict[int, dict] = {}       # gpu -> newest passed record to push
        self.pushes: dict[int, _Push] = {}
        self.on_hub: dict[int, dict] = {}       # gpu -> newest pushed record + hub_revision
        self.pushed: list[dict] = []            # not yet taken by the supervisor

    def on_passed(self, gpu: int, record: dict) -> None:
        if self.hub_url and self.backend.actor(gpu) is not None:
            self.queued[gpu] = record        # only the newest one goes up

    def stop_pushes(self, message: str) -> None:
        self.lease.refused(message, "node push")
        self.queued.clear()         # checkpoints not pushed yet stay on their nodes

    def _push_queued(self) -> None:
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
                    self.stop_pushes(str(cause))
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
        """A GPU whose node was lost: the newer of its newest passed hub copy and the
        recovery copy its lost worker's node pushed (launcher/supervise/ray_recovery.py;
        only one of that worker's start: `attempt`). A hub that cannot be read: the passed
        copy, said in the events."""
        passed = self.hub_copy(gpu)
        attempt = self.backend.attempt(gpu)
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


def newer_recovery_copy(hub_url: str, pod_dir, checkpoint: str, gpu: int, attempt: str,
                        than: tuple[int, int] | None, events, serves: str) -> dict | None:
    """The recovery copy of `gpu`'s worker start `attempt` on the hub (read_recovery_copy)
    when it is past position `than` (None: any); else None. A hub that cannot be read: None,
    said in a `recovery_copy_unread` event (`serves`: what serves instead)."""
    try:
        copy = read_recovery_copy(hub_url, pod_dir, checkpoint, gpu, attempt)
    except (HubError, OSError, ValueError) as exc:
        events.emit("recovery_copy_unread", gpu=gpu, error=describe_error(exc),
                    reason=f"the hub's recovery copy could not be read: {serves} serves")
        return None
    if copy is None or (than is not None and event_position(copy) <= than):
        return None
    return copy
