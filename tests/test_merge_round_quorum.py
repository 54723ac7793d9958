"""When MergeRounds opens a round (launcher/supervise/merge_rounds.py), on a fake clock and
fake GPU slots: at once when every GPU that could come is waiting; with the quorum there
and a GPU still running, only once grace_s has passed, leaving that GPU out; refused at
once when the quorum cannot be reached; a worker that ended is no longer counted as
waiting."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

from launcher.checks.merge_gate import MergeGate
from launcher.checks.probe_check import ProbeTolerance
from launcher.config.merge_rounds_settings import MergeRoundSettings, OuterSettings
from launcher.paths import ROUNDS_LEDGER
from launcher.pod.events import EventLog, read_events
from launcher.supervise.merge_rounds import MergeRounds
from launcher.supervise.state import GpuState


class Run(SimpleNamespace):
    def said_merge_wait(self, now):
        self.waiting = True

    def said_merge_resumed(self, now):
        self.waiting = False


class Clock:
    now = 1000.0

    def __call__(self):
        return self.now


def rounds_for(pod, quorum, grace_s, n=3):
    clock = Clock()
    runs = {g: Run(slot=SimpleNamespace(gpu=g), state=GpuState.RUNNING, proc=object(),
                   waiting=False) for g in range(n)}
    settings = MergeRoundSettings(100, False, OuterSettings(), "equal", quorum, grace_s)
    rounds = MergeRounds(settings, pod, EventLog(pod),
                         MergeGate(0.1, 64, 0, 60), ProbeTolerance(0.25, None, 3.0, 0.01),
                         clock, lambda: runs, lambda: 1, lambda gpu: None, lambda why: None,
                         lambda gpu: f"data/shard{gpu}.npy", 16)
    rounds.begin({g: 0 for g in runs})
    return rounds, runs, clock


def wait(rounds, runs, gpu, boundary=1, token=100):
    rounds.on_wait(runs[gpu], {"boundary": boundary, "next_token": token,
                               "checkpoint": f"checkpoints/g{gpu}.pt", "sha256": "0" * 64})


def ledger(pod):
    return json.loads((pod / ROUNDS_LEDGER).read_text())["rounds"]


def settle(rounds):
    """The round's thread (here: its merge refuses the missing files) and its verdict."""
    deadline = time.monotonic() + 120
    while rounds.future is not None and time.monotonic() < deadline:
        rounds.tick()
        time.sleep(0.05)


def test_a_round_opens_at_once_when_every_gpu_waits(tmp_path):
    rounds, runs, clock = rounds_for(tmp_path, quorum=2, grace_s=600)
    for gpu in (0, 1, 2):
        wait(rounds, runs, gpu)
    rounds.tick()
    (opened,) = ledger(tmp_path)
    assert sorted(opened["gpus"]) == ["0", "1", "2"] and opened["left_out"] == []
    settle(rounds)


def test_past_the_quorum_a_round_waits_grace_s_for_the_rest_then_leaves_them_out(tmp_path):
    rounds, runs, clock = rounds_for(tmp_path, quorum=2, grace_s=600)
    wait(rounds, runs, 0)
    rounds.tick()
    assert ledger(tmp_path) == []                   # below the quorum: it waits
    wait(rounds, runs, 1)
    rounds.tick()
    clock.now += 599
    rounds.tick()
    assert ledger(tmp_path) == []                   # GPU 2 still runs, within the grace
    clock.now += 2
    rounds.tick()
    (opened,) = ledger(tmp_path)
    assert sorted(opened["gpus"]) == ["0", "1"] and opened["left_out"] == [2]
    settle(rounds)
    (event,) = [e for e in read_events(tmp_path) if e["event"] == "merge_round"]
    assert event["quorum"] == [0, 1] and event["left_out"] == [2]


def test_a_gpu_that_ended_or_gave_up_does_not_hold_a_round(tmp_path):
    rounds, runs, clock = rounds_for(tmp_path, quorum=2, grace_s=600)
    wait(rounds, runs, 0)
    wait(rounds, runs, 1)
    runs[2].state, runs[2].proc = GpuState.FAILED, None       # given up: never comes
    rounds.tick()
    (opened,) = ledger(tmp_path)
    assert sorted(opened["gpus"]) == ["0", "1"] and opened["left_out"] == [2]
    settle(rounds)


def test_an_unreachable_quorum_refuses_the_round_and_a_dead_waiter_is_forgotten(tmp_path):
    rounds, runs, clock = rounds_for(tmp_path, quorum=3, grace_s=600)
    wait(rounds, runs, 0)
    wait(rounds, runs, 1)
    runs[1].proc = None                  # its worker ended while waiting: not waiting now
    runs[2].state, runs[2].proc = GpuState.DONE, None
    rounds.tick()
    (refused,) = ledger(tmp_path)
    assert refused["state"] == "refused" and sorted(refused["gpus"]) == ["0"]
    assert refused["reason"] == ("quorum 3 cannot be reached: 1 GPU(s) waiting, 1 more "
                                 "running")
    inbox = json.loads((tmp_path / "merge" / "inbox.json").read_text())
    assert inbox == {"round": 1, "stage": 1, "boundary": 1, "refused": True, "gpus": {}}
