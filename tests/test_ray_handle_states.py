"""A Ray GPU's handle moves only through the table of launcher/supervise/ray/handle.py:
every listed move lands where the table says, every other one raises IllegalTransition and
changes nothing; RayBackend's stop of a start that never answers ends it lost through that
table (no cluster: Ray's driver stubbed)."""

import time
from types import SimpleNamespace

import pytest

from launcher.supervise.backend import WorkerExit
from launcher.supervise.ray.driver import RayBackend
from launcher.supervise.ray.handle import TRANSITIONS, RayEvent, RayHandle, RayState
from launcher.supervise.state import IllegalTransition


def test_every_move_the_table_lists_lands_where_it_says_and_clears_the_call_in_flight():
    for (state, event), to in TRANSITIONS.items():
        handle = RayHandle(0, None, state=state, call="ref")
        handle.move(event)
        assert handle.state is to and handle.call is None


def test_a_move_the_table_does_not_list_raises_and_changes_nothing():
    illegal = [(s, e) for s in RayState for e in RayEvent if (s, e) not in TRANSITIONS]
    assert (RayState.LOST, RayEvent.EXITED) in illegal           # an end is final
    assert (RayState.PLACING, RayEvent.ADOPT) in illegal         # nothing to adopt yet
    assert (RayState.ENDED, RayEvent.DIED) in illegal
    for state, event in illegal:
        handle = RayHandle(0, None, state=state, call="ref")
        with pytest.raises(IllegalTransition, match=f"{event.value} in state {state.value}"):
            handle.move(event, WorkerExit(0))
        assert (handle.state, handle.call, handle.ended) == (state, "ref", None)


def test_the_only_ends_are_ended_and_lost():
    ends = {s for s in RayState if not any(k[0] is s for k in TRANSITIONS)}
    assert ends == {RayState.ENDED, RayState.LOST}
    assert all(RayHandle(0, None, state=s).done for s in ends)


def test_a_stop_of_a_start_that_never_answers_ends_it_lost_once_its_node_fenced():
    """Its node went as it was placed: the stop waits for the start, then for the fence
    (counted from the newest heartbeat), and the GPU ends lost: placing, fencing, lost."""
    backend = object.__new__(RayBackend)
    backend.actors, backend.on_lost, backend.events = {0: "actor"}, [], SimpleNamespace(
        emit=lambda *a, **k: None)
    backend.heartbeat = SimpleNamespace(lost_after=lambda actor: time.monotonic())
    backend.ray = SimpleNamespace(wait=lambda refs, num_returns=1, timeout=None: ([], refs))
    handle = RayHandle(0, None, actor="actor", call="start")
    ended = backend.stop([handle], grace_s=0)
    assert ended == {0: WorkerExit(None, node_lost=True)}
    assert handle.state is RayState.LOST and backend.actors == {}
