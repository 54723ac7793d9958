"""The launcher's side of fencing the Ray nodes (the node's side: ray_node.NodeWorker._fence).

`Heartbeat`: a thread that calls every actor's heartbeat() every HEARTBEAT_S and notes when
each one last answered. A node that hears nothing for `fence_s` stops its worker (SIGTERM,
SIGKILL after `grace_s`) and exits; the node heard the launcher at the latest when the
launcher got that answer, so once `fence_s + grace_s + FENCE_MARGIN_S` have passed since
then, its worker has stopped for certain, whatever Ray reports: only then is the GPU's node
declared lost and the GPU placed elsewhere (`lost_after`). A thread of its own, not the
supervisor's poll: a long stop or rollback in the main loop must not fence healthy nodes.

`end_orphans`: the actors are detached (they outlive a launcher killed with -9, so that
their workers get their final save); a launcher started on the same pod before they fenced
themselves stops them first (each worker saves), so that a GPU never has two workers.
"""

from __future__ import annotations

import hashlib
import socket
import threading
import time
from pathlib import Path

HEARTBEAT_S = 2.0
FENCE_MARGIN_S = 5.0       # the node's fence check period, the SIGKILL landing, clock steps
NAMESPACE = "fractus-pod"  # where the launcher finds its pod's detached actors by name


def actor_prefix(pod_dir: Path) -> str:
    """The name prefix of this pod's actors: this head and this pod directory."""
    key = hashlib.sha256(f"{socket.gethostname()}:{pod_dir.resolve()}".encode()).hexdigest()
    return f"fractus-pod-{key[:12]}-"


class Heartbeat:
    def __init__(self, ray, actors: dict[int, object], fence_s: float, grace_s: float):
        self.ray, self.actors = ray, actors         # the backend's live actors, read only
        self.wait_s = fence_s + grace_s + FENCE_MARGIN_S
        self.answered: dict[object, float] = {}     # actor -> monotonic time of its answer
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="ray-heartbeat", daemon=True)
        self.thread.start()

    def heard(self, actor) -> None:
        """An answer of `actor` (its start), outside the heartbeat thread."""
        self.answered[actor] = time.monotonic()

    def lost_after(self, actor) -> float:
        """When a GPU whose actor Ray reported dead may be placed elsewhere (monotonic):
        an actor that never answered is counted from now."""
        return self.answered.pop(actor, time.monotonic()) + self.wait_s

    def _run(self) -> None:
        while not self.stopping.wait(HEARTBEAT_S):
            beats = [(actor, actor.heartbeat.remote()) for actor in list(self.actors.values())]
            if not beats:
                continue
            ready, _ = self.ray.wait([ref for _, ref in beats], num_returns=len(beats),
                                     timeout=HEARTBEAT_S)
            answered_at, ready = time.monotonic(), set(ready)
            for actor, ref in beats:
                if ref not in ready:
                    continue
                try:
                    self.ray.get(ref, timeout=0)
                except self.ray.exceptions.RayError:
                    continue            # a dead actor: the poll reports it
                if actor in self.actors.values():
                    self.answered[actor] = answered_at

    def close(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=HEARTBEAT_S * 3)


def end_orphans(ray, prefix: str, grace_s: float, timeout_s: float) -> list[dict]:
    """Stop every live actor of this pod left by an earlier launcher (its worker saves its
    final checkpoint, SIGKILL after grace_s), then remove it; what each one said."""
    ended = []
    for name in ray.util.list_named_actors():
        if not name.startswith(prefix):
            continue
        try:
            actor = ray.get_actor(name)
        except ValueError:            # it fenced itself meanwhile
            continue
        try:
            code, _ = ray.get(actor.terminate.remote(grace_s), timeout=timeout_s)
        except ray.exceptions.RayError:
            code = None
        ray.kill(actor)
        ended.append({"actor": name, "code": code})
    return ended
