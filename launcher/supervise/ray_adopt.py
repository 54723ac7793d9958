"""A GPU's actor died on a node that is alive: a new actor there adopts the GPU.

Ray reports an actor dead (`RayActorError`) both when its node is gone and when only its
process died (killed, a crash of the actor itself). Taken as a lost node, the GPU waited
for the fence and resumed from its hub copy though the same live node held its newer
checkpoints (issue 16, item 31). When the node is alive (`ray.nodes()`), a new actor of
the GPU on that node (NodeAffinity) waits for the old worker to end (it got SIGTERM from
its dead parent and saves its final checkpoint; SIGKILL after stop_grace_s: never two
workers of one GPU), then hands over the metrics lines the launcher had not read, the final
save's checkpoint event among them (launcher/supervise/ray_node.py: NodeWorker.adopt). The
GPU then ends as a crashed worker and restarts on that node from that final save, a
restart counted. A replacement that cannot be placed, fails, or whose node goes meanwhile:
the GPU is treated as lost after all (the fence wait counted from then).

An actor Ray holds alive that does not answer a call the launcher cannot go on without (a
kill, a stop) is killed and taken over the same way (`_answer`).

A mixin of RayBackend (launcher/supervise/ray_backend.py), whose state it uses: `ray`,
`actors`, `slots`, `heartbeat`, `events`, `config`, `_new_actor`, `_append_lines`, `_log`,
`_take` and `_lost`.
"""

from __future__ import annotations

import signal
import time
from typing import TYPE_CHECKING

from launcher.supervise.backend import WorkerExit

if TYPE_CHECKING:
    from launcher.supervise.ray_backend import RayHandle

# The replacement's answer is due within the old worker's grace plus this (a call).
ADOPT_CALL_S = 120.0
ANSWER_CHECK_S = 1.0       # how often a wait for a kill's answer looks at the heartbeats


class NodeAdoption:
    def _answer(self, handle: RayHandle, ref, timeout_s: float) -> WorkerExit | None:
        """`_take` of a call the launcher cannot go on without (the poll in flight before a
        kill or stop, the kill or stop itself). An actor alive for Ray that does not answer
        within `timeout_s` (stuck, or a poll far behind its worker, as once in CI) would
        block the launcher, and with it every GPU, for ever: it is killed, and treated as
        an actor that died. Its worker gets SIGTERM from its dead parent and saves; a new
        actor on its node adopts the GPU once that worker ended, else the GPU is lost after
        the fence (`_lost`). An actor silent to the heartbeats too is frozen: killed
        sooner."""
        start = time.monotonic()
        while True:
            ready, _ = self.ray.wait([ref], timeout=ANSWER_CHECK_S)
            if ready:
                return self._take(handle, ref)
            waited = time.monotonic() - start
            if waited >= timeout_s or self.heartbeat.unresponsive(handle.actor):
                break
        self.events.emit("node_unresponsive", gpu=handle.gpu, node=handle.node,
                         waited_s=round(waited, 1),
                         action="its actor killed; the GPU is taken over as after an "
                                "actor's death")
        self._log(handle.gpu, f"the actor on node {handle.node} did not answer in "
                              f"{waited:.0f}s; killed")
        self.ray.kill(handle.actor)
        return self._lost(handle, wait=True)

    def _replace(self, handle: RayHandle) -> bool:
        """The GPU's actor died: if its node is alive (only the actor's process died), a new
        actor on that node adopts the GPU (`NodeWorker.adopt`). False: treat it as lost."""
        if handle.node_id is None or handle.read_to is None or handle.pid is None \
                or not self._alive(handle.node_id):
            return False
        self.heartbeat.lost_after(handle.actor)        # forget the dead one
        actor = self.actors[handle.gpu] = self._new_actor(self.slots[handle.gpu],
                                                          handle.node_id)
        handle.actor = actor
        handle.adopt_ref = actor.adopt.remote(handle.pid, handle.metrics, handle.read_to)
        handle.adopt_by = time.monotonic() + self.config.stop_grace_s + ADOPT_CALL_S
        self.events.emit("actor_died", gpu=handle.gpu, node=handle.node, pid=handle.pid,
                         reason="its actor's process died on a live node: a new actor on "
                                "that node takes over once the worker's final save ended")
        return True

    def _adopted(self, handle: RayHandle, timeout: float | None) -> None:
        """The replacement actor's answer: the old worker's last lines; the GPU then ends
        as a crashed worker and restarts on that node from its newest checkpoint. A
        replacement that cannot be placed or fails: the GPU is treated as lost."""
        wait_s = max(0.0, handle.adopt_by - time.monotonic()) if timeout is None else timeout
        ready, _ = self.ray.wait([handle.adopt_ref], timeout=wait_s)
        if not ready:         # its node went meanwhile, or the replacement never answers
            if time.monotonic() >= handle.adopt_by or not self._alive(handle.node_id):
                self._abandon_adoption(handle)
            return
        ref, handle.adopt_ref = handle.adopt_ref, None
        try:
            _, lines = self.ray.get(ref)
        except self.ray.exceptions.RayError:
            self._abandon_adoption(handle)
            return
        self._append_lines(handle.gpu, lines)
        self.heartbeat.heard(handle.actor)
        error = (f"its actor's process died on node {handle.node}, which is alive; the "
                 f"worker's final save ended there")
        self._log(handle.gpu, error)
        handle.ended = WorkerExit(-signal.SIGTERM, error=error)

    def _alive(self, node_id: str) -> bool:
        return any(n["NodeID"] == node_id and n["Alive"] for n in self.ray.nodes())

    def _abandon_adoption(self, handle: RayHandle) -> None:
        handle.adopt_ref, handle.node_id = None, None     # node_id: no second replacement
        self.ray.kill(handle.actor)
        self._lost(handle)

