"""The launcher's heartbeats to its Ray nodes (launcher/supervise/ray/fence.py: Heartbeat),
over stub actors and a stub `ray` whose answers the test controls (the heartbeat thread's
own logic; the real cluster's fencing is in tests/test_ray_pod.py).

A round used to wait for every actor's answer before sleeping a period: one actor that does
not answer (a lost node's, one still starting) slowed every other actor's heartbeats to one
per two periods, and a node with a short fence_s fenced a healthy worker (the Ray test,
under load: new actors fenced themselves over and over before their workers started)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from launcher.supervise.ray.fence import Heartbeat
from tests.support.ray_stub import HeartbeatRay as StubRay, HeartbeatRef as Ref

PERIOD_S = 0.25


@dataclass(eq=False)
class Actor:
    answers: bool
    calls: list = field(default_factory=list)

    @property
    def heartbeat(self):
        return self

    def remote(self, *deadlines):
        self.calls.append(time.monotonic())
        return Ref(self.answers)


def test_an_actor_that_does_not_answer_slows_no_other_actors_heartbeats():
    healthy, silent = Actor(answers=True), Actor(answers=False)
    heartbeat = Heartbeat(StubRay(), {0: healthy, 1: silent}, fence_s=60, grace_s=10,
                          period_s=PERIOD_S)
    try:
        time.sleep(PERIOD_S * 12.5)
    finally:
        heartbeat.close()
    # One per period (12 periods): a round that waited for the silent actor sent 6 (the
    # margin: 3 periods of scheduling delay on a loaded machine).
    assert len(healthy.calls) >= 9, len(healthy.calls)
    # The silent one keeps its one heartbeat in flight: no pile-up behind its queue.
    assert len(silent.calls) == 1
    assert healthy in heartbeat.answered and silent not in heartbeat.answered


def test_an_answer_counts_from_when_it_was_seen_never_earlier():
    """The deadline after which a lost node's GPU moves (`lost_after`) counts from the
    answer: never before the node heard the heartbeat, or a GPU could train twice."""
    actor = Actor(answers=True)
    heartbeat = Heartbeat(StubRay(), {0: actor}, fence_s=5, grace_s=10, period_s=PERIOD_S)
    try:
        time.sleep(PERIOD_S * 4.5)
    finally:
        heartbeat.close()
    sent = actor.calls
    assert heartbeat.answered[actor] >= sent[-2]        # the answer of a heartbeat it sent
    assert heartbeat.lost_after(actor) >= sent[-2] + 5 + 10 + 5
