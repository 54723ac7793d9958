"""The launcher's side of fencing the Ray nodes (the node's: node_process.ProcessHost._fence).

Invariant: a GPU never has two workers. A node that hears nothing for its fence stops its
worker (SIGTERM, SIGKILL after its grace) and exits; the launcher places that node's GPUs
elsewhere only once the same deadline, counted from its side, has passed for certain
(`lost_after`). Owner: `Heartbeat`, for RayBackend. The deadlines and why: docs/LAUNCHER.md,
Multi-node pods on Ray, Fencing.
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

HEARTBEAT_S = 2.0
FENCE_MARGIN_S = 5.0       # the node's fence check period, the SIGKILL landing, clock steps
NAMESPACE = "fractus-pod"  # where the launcher finds its pod's detached actors by name
# The floors: a loaded node's answers came seconds late. The caps hold until measured.
FENCE_GAPS = 5
FENCE_FLOOR_S = 15.0
GRACE_FACTOR = 1.5
GRACE_FLOOR_S = 10.0
MEASURED_KEPT = 256        # the newest measurements of each kind a derivation looks at


@dataclass(frozen=True)
class Deadlines:
    fence_s: float
    grace_s: float

    @property
    def wait_s(self) -> float:
        """From the node's last heartbeat until its worker has stopped for certain."""
        return self.fence_s + self.grace_s + FENCE_MARGIN_S


def derive_deadlines(gaps_s, steps_s, saves_s, fence_cap_s: float,
                     grace_cap_s: float) -> Deadlines:
    """From the measured answer gaps, step and save times (seconds; empty: the cap holds)."""
    gaps, steps, saves = list(gaps_s), list(steps_s), list(saves_s)
    fence = min(fence_cap_s, max(FENCE_FLOOR_S, FENCE_GAPS * max(gaps))) if gaps \
        else fence_cap_s
    grace = min(grace_cap_s, max(GRACE_FLOOR_S, GRACE_FACTOR * (max(steps, default=0.0)
                                                                + max(saves)))) if saves \
        else grace_cap_s
    return Deadlines(fence, grace)


class Measured:
    """What the deadlines derive from. Two threads feed it: appends only."""

    def __init__(self):
        self.gaps = deque(maxlen=MEASURED_KEPT)
        self.steps = deque(maxlen=MEASURED_KEPT)
        self.saves = deque(maxlen=MEASURED_KEPT)
        self.last_metrics: dict[int, tuple[float, int]] = {}   # gpu -> (ts, step)

    def note_lines(self, gpu: int, lines: bytes) -> None:
        """Step times from consecutive metrics lines, save times from checkpoint events."""
        for line in lines.splitlines():
            if b'"metrics"' not in line and b'"checkpoint"' not in line:
                continue
            try:
                record = json.loads(line)
                if record.get("type") == "metrics":
                    ts, step = float(record["ts"]), int(record["step"])
                    previous = self.last_metrics.get(gpu)
                    self.last_metrics[gpu] = (ts, step)
                    if previous and step > previous[1] and ts >= previous[0]:
                        self.steps.append((ts - previous[0]) / (step - previous[1]))
                elif record.get("event") == "checkpoint" and "seconds" in record:
                    self.saves.append(max(0.0, float(record["seconds"])))
            except (ValueError, TypeError, KeyError, AttributeError):
                continue             # a line not of that shape measures nothing


def actor_prefix(pod_dir: Path) -> str:
    """The name prefix of this pod's actors (this head, this pod directory)."""
    key = hashlib.sha256(f"{socket.gethostname()}:{pod_dir.resolve()}".encode()).hexdigest()
    return f"fractus-pod-{key[:12]}-"


class Heartbeat:
    def __init__(self, ray, actors: dict[int, object], fence_s: float, grace_s: float,
                 period_s: float = HEARTBEAT_S):
        self.ray, self.actors = ray, actors         # the backend's live actors, read only
        self.caps = Deadlines(fence_s, grace_s)     # what a new actor keeps (its arguments)
        self.measured = Measured()
        self.period_s = period_s
        self.answered: dict[object, float] = {}     # actor -> monotonic time of its answer
        self.in_flight: dict[object, object] = {}   # actor -> its heartbeat not answered yet
        self.sent: dict[object, tuple[float, Deadlines]] = {}   # actor -> its newest heartbeat
        self.kept: dict[object, Deadlines] = {}     # actor -> those of its last answered one
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="ray-heartbeat", daemon=True)
        self.thread.start()

    def deadlines(self) -> Deadlines:
        """What the next heartbeats tell the nodes to keep."""
        m = self.measured
        return derive_deadlines(m.gaps, m.steps, m.saves, self.caps.fence_s,
                                self.caps.grace_s)

    def wait_s(self, actor) -> float:
        """How long after its last heartbeat `actor`'s worker has stopped for certain: the
        larger of its last answered heartbeat's (or its arguments') and its newest one's."""
        kept = self.kept.get(actor, self.caps)
        sent = self.sent.get(actor)
        return max(kept.wait_s, sent[1].wait_s if sent else 0.0)

    def heard(self, actor) -> None:
        """An answer of `actor` (its start) outside the heartbeat thread."""
        self.answered[actor] = time.monotonic()

    def unresponsive(self, actor) -> bool:
        """No answer for its wait while alive to Ray: frozen (a running one would have fenced)."""
        answered = self.answered.get(actor)
        return answered is not None and time.monotonic() - answered > self.wait_s(actor)

    def lost_after(self, actor) -> float:
        """Monotonic time when a GPU whose actor died may be placed elsewhere: from its last
        answer or newest heartbeat, whichever is later (never answered: from now)."""
        wait_s = self.wait_s(actor)
        answered = self.answered.pop(actor, time.monotonic())
        sent = self.sent.pop(actor, None)
        self.kept.pop(actor, None)
        return max(answered, sent[0] if sent else answered) + wait_s

    def _run(self) -> None:
        while not self.stopping.wait(self.period_s):
            self.tick()

    def tick(self) -> None:
        """Note the answers since the last tick, then heartbeat each actor without one in
        flight. Never waits: one silent actor would slow every other's heartbeats and fence
        healthy nodes. An answer is noted up to a period late, never early, so `lost_after`
        stays on the safe side."""
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
                    previous = self.answered.get(actor)
                    if previous is not None:
                        self.measured.gaps.append(seen_at - previous)
                    self.answered[actor] = seen_at
                    sent = self.sent.get(actor)
                    if sent is not None:
                        self.kept[actor] = sent[1]
        deadlines = self.deadlines()
        for actor in live:
            if actor not in self.in_flight:
                self.sent[actor] = (time.monotonic(), deadlines)
                self.in_flight[actor] = actor.heartbeat.remote(deadlines.fence_s,
                                                               deadlines.grace_s)

    def close(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=self.period_s * 3)


def end_orphans(ray, prefix: str, grace_s: float, timeout_s: float) -> list[dict]:
    """Stop and remove every actor of this pod an earlier launcher left (its worker saves)."""
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
