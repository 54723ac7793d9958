"""End to end, merge rounds (issue 28): real launcher, real tiny CPU workers, real files. Two
GPUs on shards of 240 tokens (each ends its shard at step 7, the run's end whatever
restarts happen), a round boundary every 3 steps: rounds at steps 3 and 6. Each GPU adopts
the merged weights in place at its exact next token; a kill -9 of the launcher at any point
of a round, or of a worker waiting in one, then a relaunch, ends bitwise equal to the
uninterrupted run; a GPU that cannot come is left out, or the round is refused when the
quorum cannot be reached, and nothing changes then.

Uses the pod helpers of tests/support/e2e.py.
"""

from __future__ import annotations

import copy
import json
import os

import numpy as np
import pytest
import torch
import yaml

from fractus.data import write_npy_atomic
from fractus.legacy import read_checkpoint
from launcher.files import sha256_file
from launcher.pod.events import read_events
from launcher.paths import MERGE_INBOX_FILE, OUTER_STATE_FILE, ROUNDS_LEDGER
from launcher.supervise.merge_rounds import FAULT_ENV
from tests.support.e2e import (PROCESS_S, TEST_CRITERIA, TOKENS_PER_STEP, Launcher, events_of,
                               kill_workers, launchers, make_pod, manifest_json, wait_for,
                               worker_records)

__all__ = ["launchers"]   # the fixture, imported for pytest

EVERY = 3 * TOKENS_PER_STEP
SHARD = 240               # end_of_shard after step 7: next_token 224 + 32 + 1 > 240
ROUNDS = {"every_tokens": EVERY, "outer": "nesterov", "lr": 0.7, "momentum": 0.9}
CRITERIA = {**copy.deepcopy(TEST_CRITERIA),
            "merge_gate": {"max_tf_rise": 50.0, "window_tokens": 64, "probe": 0}}


def rounds_pod(root, shard_tokens=(SHARD, SHARD), **rounds) -> "Path":
    pod = make_pod(root, criteria=CRITERIA, save_every=100,
                   merge_rounds={**ROUNDS, **rounds})
    whole = np.load(pod / "data" / "shard_phase2_gpu0.npy")
    for gpu, n in enumerate(shard_tokens):     # the same walk, cut short: reproducible
        source = np.load(pod / "data" / f"shard_phase2_gpu{gpu}.npy") if gpu else whole
        write_npy_atomic(pod / "data" / f"shard_phase2_gpu{gpu}.npy", source[:n].copy())
    return pod


def launch(pod, launchers, env=None, *args):
    saved = dict(os.environ)
    os.environ.update(env or {})
    try:
        launcher = Launcher(pod, "--stage", "1", "--no-canary", *args)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    launchers.append(launcher)
    return launcher


def final_state(pod) -> dict:
    """What must be equal between two runs: each GPU's weights, optimizer state and tokens,
    the outer state, the manifest's tokens, the ledger's verdicts."""
    state = {}
    for gpu in (0, 1):
        ck = read_checkpoint(pod / "checkpoints" / f"fractus_1b_gpu{gpu}.pt")
        state[f"gpu{gpu}"] = (ck["model_state"], ck["optimizer_state"]["state"],
                              ck["train_state"]["next_token"], ck["train_state"].get("merge_round"))
    outer = read_checkpoint(pod / OUTER_STATE_FILE)
    state["outer"] = (outer["round"], outer["outer"], outer["momentum"])
    state["manifest"] = {g: e["start_token"] for g, e in manifest_json(pod).items()
                         if g.startswith("gpu_")}
    ledger = json.loads((pod / ROUNDS_LEDGER).read_text())
    state["verdicts"] = [(r["round"], r["state"], r["merged_sha256"]) for r in ledger["rounds"]]
    return state


def assert_equal(a, b, where="") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), where
        for k in a:
            assert_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run: two rounds, both adopted."""
    started = []
    pod = rounds_pod(tmp_path_factory.mktemp("reference"))
    try:
        first = launch(pod, started)
        assert first.wait(PROCESS_S) == 0, first.output()
        yield pod, final_state(pod)
    finally:
        for launcher in started:
            launcher.cleanup()


def test_rounds_merge_gate_and_adopt_in_place_at_the_exact_token(reference):
    pod, state = reference
    rounds = events_of(pod, "merge_round")
    assert [(e["round"], e["boundary"], e["verdict"], e["quorum"]) for e in rounds] == \
        [(1, 1, "adopted", [0, 1]), (2, 2, "adopted", [0, 1])]
    assert all(set(e["gate"]["gpus"]) == {"0", "1"} for e in rounds)
    assert state["outer"][0] == 2 and state["verdicts"][1][1] == "adopted"
    for gpu in (0, 1):
        records = worker_records(pod, gpu)
        # In place: one worker process for the whole run, no restart, no reload.
        assert len([r for r in records if r.get("event") == "start"]) == 1
        waits = [r for r in records if r.get("event") == "merge_wait"]
        adopted = [r for r in records if r.get("event") == "merge_adopted"]
        assert [w["next_token"] for w in waits] == [EVERY, 2 * EVERY]
        assert [(a["round"], a["at_token"]) for a in adopted] == [(1, EVERY), (2, 2 * EVERY)]
        # No step between the wait and the adoption: the next token stays the boundary's.
        steps = [r["step"] for r in records if r.get("type") == "metrics"]
        assert steps == list(range(1, 8))
        assert state[f"gpu{gpu}"][2:] == (224, 2)
    inbox = json.loads((pod / MERGE_INBOX_FILE).read_text())
    assert inbox["round"] == 2 and inbox["gpus"] == {"0": 2 * EVERY, "1": 2 * EVERY}


def test_adopted_weights_are_the_merged_file(tmp_path, launchers):
    """Stopped right after round 1: each GPU's checkpoint holds exactly the round's
    parameters (its carried state its own), and its optimizer state went on untouched."""
    pod = rounds_pod(tmp_path)
    config = yaml.safe_load((pod / "fractus-pod.yaml").read_text())
    run = launch(pod, launchers, None, "--max-steps", "3")
    assert run.wait(PROCESS_S) == 0, run.output()
    merged = read_checkpoint(pod / "merge" / "round_00001.pt")["params"]
    for gpu in (0, 1):
        ck = read_checkpoint(pod / config["checkpoints"].format(i=gpu))
        assert ck["train_state"]["merge_round"] == 1 and ck["train_state"]["next_token"] == EVERY
        for name, tensor in merged.items():
            if "level_offsets" in name or "expert_phases" in name:
                continue
            assert torch.equal(ck["model_state"][name], tensor), name
        (boundary,) = worker_records(pod, gpu, "merge_wait")
        assert boundary["next_token"] == EVERY     # its newest file is the merged one's save
        assert sha256_file(pod / config["checkpoints"].format(i=gpu)) != boundary["sha256"]


@pytest.mark.parametrize("point", ["started", "merged", "decided"])
def test_launcher_killed_during_a_round_relaunches_bitwise_equal(point, reference, tmp_path,
                                                                 launchers):
    pod = rounds_pod(tmp_path)
    first = launch(pod, launchers, {FAULT_ENV: point})
    assert first.wait(PROCESS_S) == -9, first.output()
    ledger = json.loads((pod / ROUNDS_LEDGER).read_text())
    assert ledger["rounds"][0]["state"] == ("adopted" if point == "decided" else "merging")
    second = launch(pod, launchers)
    assert second.wait(PROCESS_S) == 0, second.output()
    if point != "decided":
        (forgotten,) = events_of(pod, "merge_round_forgotten")
        assert forgotten["round"] == 1
    assert_equal(final_state(pod), reference[1], point)


def test_launcher_killed_before_the_saves_relaunches_bitwise_equal(reference, tmp_path,
                                                                   launchers):
    """Killed while the GPUs train toward the first boundary (whenever the kill lands, the
    relaunch must end where the uninterrupted run did)."""
    pod = rounds_pod(tmp_path)
    first = launch(pod, launchers)
    wait_for(lambda: worker_records(pod, 0, "start"), PROCESS_S, "GPU 0's worker to start")
    first.proc.kill()
    first.proc.wait()
    kill_workers(pod)
    second = launch(pod, launchers)
    assert second.wait(PROCESS_S) == 0, second.output()
    assert_equal(final_state(pod), reference[1])


def test_worker_killed_at_its_boundary_rejoins_and_ends_equal(reference, tmp_path, launchers):
    pod = rounds_pod(tmp_path)
    run = launch(pod, launchers, None, "--fault", "0:kill_after_save@3")
    assert run.wait(PROCESS_S) == 0, run.output()
    starts = worker_records(pod, 0, "start")
    assert [s["next_token"] for s in starts] == [0, EVERY]
    assert_equal(final_state(pod), reference[1])


def test_a_crash_after_a_round_resumes_from_the_rounds_weights(reference, tmp_path, launchers):
    """GPU 0 crashes at step 5: it restarts from its checkpoint of round 1's weights (what a
    rollback goes back to), not from its boundary file, and takes round 1 only once."""
    pod = rounds_pod(tmp_path)
    run = launch(pod, launchers, None, "--fault", "0:crash@5")
    assert run.wait(PROCESS_S) == 0, run.output()
    starts = worker_records(pod, 0, "start")
    assert [s["next_token"] for s in starts] == [0, EVERY]
    assert [a["round"] for a in worker_records(pod, 0, "merge_adopted")] == [1, 2]
    assert_equal(final_state(pod), reference[1])


def test_a_gpu_that_cannot_come_is_left_out(tmp_path, launchers):
    """GPU 1's shard ends before the first boundary: quorum 1 merges GPU 0 alone."""
    pod = rounds_pod(tmp_path, shard_tokens=(SHARD, 80), quorum=1)
    run = launch(pod, launchers)
    assert run.wait(PROCESS_S) == 0, run.output()
    rounds = events_of(pod, "merge_round")
    assert [(e["verdict"], e["quorum"], e["left_out"]) for e in rounds] == \
        [("adopted", [0], [1]), ("adopted", [0], [1])]
    assert not worker_records(pod, 1, "merge_adopted")


def test_a_refused_round_changes_nothing_and_the_next_tries_again(tmp_path, launchers):
    """Quorum 2, GPU 1 ends before the boundary: each round is refused; GPU 0 trains on
    with its own weights, no outer state is written."""
    pod = rounds_pod(tmp_path, shard_tokens=(SHARD, 80))
    run = launch(pod, launchers, None, "--max-steps", "3")
    assert run.wait(PROCESS_S) == 0, run.output()
    (refused,) = events_of(pod, "merge_round")
    assert refused["verdict"] == "refused" and "quorum 2 cannot be reached" in refused["reason"]
    (skipped,) = worker_records(pod, 0, "merge_skipped")
    assert (skipped["round"], skipped["reason"]) == (1, "refused")
    assert not (pod / OUTER_STATE_FILE).exists()
    assert not list((pod / "merge").glob("round_*.pt"))
    (wait,) = worker_records(pod, 0, "merge_wait")
    ck = pod / "checkpoints" / "fractus_1b_gpu0.pt"
    assert sha256_file(ck) == wait["sha256"]      # its boundary checkpoint, untouched
    again = launch(pod, launchers)
    assert again.wait(PROCESS_S) == 0, again.output()
    assert [e["round"] for e in events_of(pod, "merge_round")] == [1, 2]


def test_a_round_at_the_stages_end_is_taken_at_the_next_start(tmp_path, launchers):
    """at_stage_end: the launch's final checkpoints are merged before the pod is done; the
    next launch's workers start from the merged weights at their own tokens."""
    pod = make_pod(tmp_path, criteria=CRITERIA, save_every=100,
                   merge_rounds={"at_stage_end": True})
    first = launch(pod, launchers, None, "--max-steps", "2")
    assert first.wait(PROCESS_S) == 0, first.output()
    (merged,) = events_of(pod, "merge_round")
    assert (merged["boundary"], merged["verdict"], merged["quorum"]) == (None, "adopted", [0, 1])
    kinds = [e["event"] for e in read_events(pod)]
    assert kinds.index("merge_round") < kinds.index("pod_done")     # decided, then done
    assert not worker_records(pod, 0, "merge_wait")          # no boundaries: no pause
    second = launch(pod, launchers, None, "--max-steps", "1")
    assert second.wait(PROCESS_S) == 0, second.output()
    for gpu in (0, 1):
        (adopted,) = worker_records(pod, gpu, "merge_adopted")
        assert (adopted["round"], adopted["at_token"]) == (1, 2 * TOKENS_PER_STEP)
        starts = worker_records(pod, gpu, "start")
        assert starts[1]["next_token"] == 2 * TOKENS_PER_STEP
        records = worker_records(pod, gpu)
        after_start = records[records.index(starts[1]):]
        # Taken before its first step of the second launch: no metrics line before it.
        assert after_start.index(adopted) < next(
            i for i, r in enumerate(after_start) if r.get("type") == "metrics")
    # The second launch's end is a stage end too: round 2; only the newest file is kept.
    assert [e["round"] for e in events_of(pod, "merge_round")] == [1, 2]
    assert sorted(p.name for p in (pod / "merge").glob("round_*.pt")) == ["round_00002.pt"]
