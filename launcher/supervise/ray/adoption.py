"""A GPU's actor died on a node that is alive: a new actor there adopts the GPU.

Invariant: never two workers of one GPU, and a live node's newer checkpoints are not
thrown away for its hub copy. Ray reports an actor dead also when only its process died; a
replacement on that node then waits for the old worker's final save (NodeWorker.adopt).
Owner: `NodeAdoption`, which RayBackend holds.
"""

from __future__ import annotations

import time
from typing import Callable

from launcher.supervise.ray.handle import RayEvent, RayHandle

# The replacement's answer is due within the old worker's grace plus this (a call).
ADOPT_CALL_S = 120.0


class AdoptionFailed(Exception):
    pass


class NodeAdoption:
    def __init__(self, ray, heartbeat, grace_s: float, new_actor: Callable[[int, str], object]):
        self.ray, self.heartbeat, self.grace_s = ray, heartbeat, grace_s
        self.new_actor = new_actor        # (gpu, node_id) -> a new actor of it on that node

    def begin(self, handle: RayHandle) -> bool:
        """A new actor on the dead actor's node adopts the GPU; False: treat the GPU as lost."""
        if handle.node_id is None or handle.read_to is None or handle.pid is None \
                or not self.alive(handle.node_id):
            return False
        self.heartbeat.lost_after(handle.actor)        # forget the dead one
        handle.move(RayEvent.ADOPT)
        handle.actor = self.new_actor(handle.gpu, handle.node_id)
        handle.call = handle.actor.adopt.remote(handle.pid, handle.metrics, handle.read_to)
        handle.deadline = time.monotonic() + self.grace_s + ADOPT_CALL_S
        return True

    def collect(self, handle: RayHandle, timeout: float | None) -> bytes | None:
        """The old worker's last lines once the replacement answered (None: not yet;
        `timeout` None: wait until the deadline). AdoptionFailed: the replacement is killed."""
        wait_s = max(0.0, handle.deadline - time.monotonic()) if timeout is None else timeout
        ready, _ = self.ray.wait([handle.call], timeout=wait_s)
        if not ready:         # its node went meanwhile, or the replacement never answers
            if timeout is not None and time.monotonic() < handle.deadline \
                    and self.alive(handle.node_id):
                return None
        else:
            try:
                _, lines = self.ray.get(handle.call)
                self.heartbeat.heard(handle.actor)
                return lines
            except self.ray.exceptions.RayError:
                pass
        self.ray.kill(handle.actor)
        raise AdoptionFailed

    def alive(self, node_id: str) -> bool:
        return any(n["NodeID"] == node_id and n["Alive"] for n in self.ray.nodes())
