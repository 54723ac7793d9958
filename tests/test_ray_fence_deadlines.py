"""The fence's deadlines derive from what the launcher measured (launcher/supervise/
ray/fence.py: Heartbeat, Measured, derive_deadlines), and never two workers of a GPU: a
node keeps the deadlines its heartbeats carry (ray.node_process.ProcessHost.heartbeat, its own
code over a stub of its state), and the launcher declares the node lost only after the
largest deadline the node may keep, counted from the newest heartbeat it may have heard.

The deadlines were fixed: fence_s 60 + stop_grace_s 120 + 5 s on every node loss, 95-160 s
to declare a lost node lost and 124-232 s until its GPUs trained again (the Ray benchmark,
under load). The heartbeats are driven tick by tick here: nothing depends on timing."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from launcher.supervise.ray.fence import (FENCE_FLOOR_S, GRACE_FLOOR_S, Deadlines, Heartbeat,
                                          derive_deadlines)
from launcher.supervise.ray.node_process import FENCE_CHECK_S, ProcessHost
from tests.support.ray_stub import HeartbeatRay as StubRay, HeartbeatRef as Ref

CAPS = (60.0, 120.0)              # the defaults: ray.fence_s, stop_grace_s


@dataclass(eq=False)
class Node:
    """A node actor's fence state; its heartbeat() is ProcessHost's own."""
    fence_s: float
    fence_grace_s: float
    heard: float = field(default_factory=time.monotonic)

    def stops_by(self) -> float:
        """When its worker has stopped for certain (its fence check, then the grace)."""
        return self.heard + self.fence_s + FENCE_CHECK_S + self.fence_grace_s


@dataclass(eq=False)
class Actor:
    node: Node
    delivers: bool = True         # the node hears the heartbeat
    answers: bool = True          # ... and its answer reaches the launcher

    @property
    def heartbeat(self):
        return self

    def remote(self, fence_s, grace_s):
        if self.delivers:
            ProcessHost.heartbeat(self.node, fence_s, grace_s)
        return Ref(self.delivers and self.answers)


def lines(*records: dict) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in records)


def one_b_saves(heartbeat: Heartbeat, save_s: float) -> None:
    """Metrics lines 1 s a step apart and a save of `save_s`, as the poll hands them over."""
    heartbeat.measured.note_lines(0, lines(
        {"type": "metrics", "ts": 1000.0, "step": 40, "tok_s": 1.0},
        {"type": "metrics", "ts": 1040.0, "step": 80, "tok_s": 1.0},
        {"type": "event", "event": "checkpoint", "ts": 1041.0, "seconds": save_s}))


def test_deadlines_derive_from_measured_gaps_steps_and_saves_within_floor_and_cap():
    assert derive_deadlines([], [], [], *CAPS) == Deadlines(*CAPS)     # nothing measured
    derived = derive_deadlines([2.0, 2.1], [1.0], [20.0], *CAPS)
    assert derived == Deadlines(FENCE_FLOOR_S, 1.5 * (1.0 + 20.0))
    assert derive_deadlines([2.0], [0.01], [0.1], *CAPS).grace_s == GRACE_FLOOR_S
    assert derive_deadlines([9.0], [1.0], [300.0], *CAPS) == Deadlines(45.0, 120.0)
    assert derive_deadlines([2.0], [], [1.0], 5.0, 30.0).fence_s == 5.0   # a short cap


def test_at_the_defaults_a_lost_nodes_gpus_move_within_60s_of_its_last_heartbeat():
    """1 s steps and a 20 s save measured (the 1B order): the node fences after 15 s and its
    worker has 31.5 s to stop; its GPUs are placed again 51.5 s after its last heartbeat
    (it was 185 s), and a node keeps the shorter deadlines once told."""
    node = Node(*CAPS)
    actor = Actor(node)
    heartbeat = Heartbeat(StubRay(), {0: actor}, *CAPS, period_s=3600)   # ticked by hand
    try:
        heartbeat.tick()                    # sent with the caps: nothing measured yet
        heartbeat.tick()                    # answered (no gap yet); sent again
        assert heartbeat.wait_s(actor) == 60 + 120 + 5
        one_b_saves(heartbeat, 20.0)
        heartbeat.tick()                    # a gap measured: the deadlines shorten
        assert (node.fence_s, node.fence_grace_s) == (15.0, 31.5)
        heartbeat.tick()                    # ... and the node's answer says it keeps them
        assert heartbeat.wait_s(actor) == 15.0 + 31.5 + 5 <= 60
        actor.delivers = False              # the node is lost
        heartbeat.tick()
        assert heartbeat.lost_after(actor) >= node.stops_by()
    finally:
        heartbeat.close()


def test_a_heartbeat_heard_but_not_answered_counts_with_its_own_deadlines():
    """The node heard the newest heartbeat (longer deadlines: a slow save was measured), its
    answer was lost: the launcher counts from that heartbeat, with its deadlines."""
    node = Node(*CAPS)
    actor = Actor(node)
    heartbeat = Heartbeat(StubRay(), {0: actor}, *CAPS, period_s=3600)
    try:
        one_b_saves(heartbeat, 2.0)
        for _ in range(4):                 # told, and kept: answered
            heartbeat.tick()
        assert heartbeat.wait_s(actor) == FENCE_FLOOR_S + GRACE_FLOOR_S + 5
        one_b_saves(heartbeat, 60.0)       # a slower save: a longer grace from now
        actor.answers = False              # heard, and then the node is cut off
        heartbeat.tick()
        heartbeat.tick()
        assert node.fence_grace_s == 1.5 * 61
        assert heartbeat.wait_s(actor) == FENCE_FLOOR_S + 1.5 * 61 + 5
        assert heartbeat.lost_after(actor) >= node.stops_by()
    finally:
        heartbeat.close()
