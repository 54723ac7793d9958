"""The launcher's side of fencing the Ray nodes (the node's side: ray_node.NodeWorker._fence).

`Heartbeat`: a thread that calls every actor's heartbeat() every HEARTBEAT_S (one call in
flight per actor, never waiting for an answer) and notes when each one last answered. A
node that hears nothing for `fence_s` stops its worker (SIGTERM, SIGKILL after `grace_s`)
and exits; the node heard the launcher at the latest when the
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
    def __init__(self, ray, actors: dict[int, object], fence_s: float, grace_s: float,
                 period_s: float = HEARTBEAT_S):
        self.ray, self.actors = ray, actors         # the backend's live actors, read only
        self.wait_s = fence_s + grace_s + FENCE_MARGIN_S
        self.period_s = period_s
        self.answered: dict[object, float] = {}     # actor -> monotonic time of its answer
        self.in_flight: dict[object, object] = {}   # actor -> its heartbeat not answered yet
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="ray-heartbeat", daemon=True)
        self.thread.start()

    def heard(self, actor) -> None:
        """An answer of `actor` (its start), outside the heartbeat thread."""
        self.answered[actor] = time.monotonic()

    def unresponsive(self, actor) -> bool:
        """Ray holds `actor` alive but it has not answered a heartbeat for `wait_s`: its
        process is frozen (stopped, or a thread holding the interpreter), since a process
        that runs would have fenced itself and ended by then."""
        answered = self.answered.get(actor)
        return answered is not None and time.monotonic() - answered > self.wait_s

    def lost_after(self, actor) -> float:
        """When a GPU whose actor Ray reported dead may be placed elsewhere (monotonic):
        an actor that never answered is counted from now."""
        return self.answered.pop(actor, time.monotonic()) + self.wait_s

    def _run(self) -> None:
        while not self.stopping.wait(self.period_s):
            self.tick()

    def tick(self) -> None:
        """Note the heartbeats answered since the last tick, then send one to each actor
        without one in flight. Never waits for an answer: a round that waited for every
        actor let one that does not answer (a lost node's, one still starting) slow every
        other actor's heartbeats to one per two periods, and a node whose fence_s is
        close to that fenced a healthy worker (the Ray test, under load). An answer is
        noted when seen, up to a period after the node heard it: later, never earlier, so
        the deadline counted from it (`lost_after`) stays on the safe side."""
        live = list(self.actors.values())
        if self.in_flight:
            ready, _ = self.ray.wait(list(self.in_flight.values()),
                                     num_returns=len(self.in_flight), timeout=0)
            seen_at, ready = time.monotonic(), set(ready)
            for actor, ref in list(self.in_flight.items()):
                if ref not in ready and actor in live:
                    continue
                del self.in_flight[actor]       # answered, failed, or no longer ours
                if ref not in ready:
                    continue
                try:
                    self.ray.get(ref, timeout=0)
                except self.ray.exceptions.RayError:
                    continue            # a dead actor: the poll reports it
                if actor in live:
                    self.answered[actor] = seen_at
        for actor in live:
            if actor not in self.in_flight:
                self.in_flight[actor] = actor.heartbeat.remote()

    def close(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=self.period_s * 3)


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
