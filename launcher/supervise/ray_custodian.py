"""`RayCustodian`: the checkpoints of a Ray pod, which are on the nodes that wrote them.

Each node retains its GPU's checkpoints, fetches what its worker resumes from, and probes
them (launcher/supervise/ray_node.py). This is the head's side: a checkpoint that passes is
pushed to the hub by the node that holds it (NodePushes, launcher/supervise/ray_pushes.py),
the revisions it pushed are handed to the supervisor (`take_pushed`), a GPU whose node was
lost resumes from its hub copy (`hub_copy`) or its newer recovery copy (`resume_copy`,
launcher/supervise/ray_recovery.py), and AR probes run on the nodes (`NodeProbes`,
launcher/supervise/ray_probes.py). A push refused because another pod took the run over is
recorded in the run's one lease (`lease`, which the hub sync shares): no node pushes again.

It reaches the nodes only through RayBackend's narrow accessor: `actor(gpu)`, `node(gpu)`
and `attempt(gpu)` (the worker start its recovery copies carry), the driver (`ray`), and
`on_lost` (a GPU's node was lost: its queued push is dropped, never sent from the node that
replaces it).
"""

from __future__ import annotations

import time

from launcher.supervise.custodian import NodeCustodian
from launcher.supervise.ray_backend import ROUND_TRIP_S, RayBackend
from launcher.supervise.ray_probes import NodeProbes
from launcher.supervise.ray_pushes import NodePushes

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

    def close(self, abandoned=lambda: False) -> None:
        """The last passed checkpoints go up (a second signal abandons them), before the
        backend's actors go."""
        deadline = time.monotonic() + PUSH_WAIT_S
        self._push_queued()
        while self.pushes and not abandoned() and time.monotonic() < deadline:
            self._harvest_pushes(timeout=0.5)
            self._push_queued()
