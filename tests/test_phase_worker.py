"""The worker's side of a data phase switch (PHASE, fractus/train/resume.py): a checkpoint
that ended phase N-1 starts phase N at token 0 of its shard with its weights, optimizer
state, carry and RNG, exactly as a by-hand switch (FORCE_START_TOKEN) that loads them all;
any other phase is refused before anything is written."""

from __future__ import annotations

import pytest
import torch

from tests.support.worker_utils import (events, load_ckpt, read_jsonl, run_worker, worker_env,
                                        write_synth_shard)

TOKENS_PER_STEP = 2 * 16     # TEST_DEFAULTS: BATCH 2, SEQ 16


@pytest.fixture(scope="module")
def phase_one(tmp_path_factory):
    """Phase 1 trained to the end of its tiny shard: its final checkpoint (read only)."""
    tmp_path = tmp_path_factory.mktemp("phase1")
    shard = write_synth_shard(tmp_path / "data" / "phase1.npy", tokens=5 * TOKENS_PER_STEP + 1)
    env = worker_env(tmp_path, SHARD=shard)
    proc = run_worker(env)
    assert proc.returncode == 0, proc.stderr
    done = events(read_jsonl(env["METRICS"]), "done")[-1]
    assert done["reason"] == "end_of_shard" and done["phase"] == 1
    return env["CKPT_OUT"], done


def _tensors_equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_tensors_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_tensors_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_phase_two_starts_at_token_zero_with_the_phase_one_state(tmp_path, phase_one):
    ended, done = phase_one
    phase1 = load_ckpt(ended)
    assert phase1["train_state"]["phase"] == 1
    shard2 = write_synth_shard(tmp_path / "data" / "phase2.npy", tokens=4000, seed=7)

    switched = worker_env(tmp_path / "switch", SHARD=shard2, CKPT_IN=ended, PHASE=2,
                          START_TOKEN=0, MAX_STEPS=2)
    proc = run_worker(switched)
    assert proc.returncode == 0, proc.stderr
    records = read_jsonl(switched["METRICS"])
    start = events(records, "start")[0]
    assert (start["resume"], start["next_token"], start["step"]) == \
        ("full", 0, done["step"])
    assert not events(records, "warning")          # a switch, not a forced token
    # The same two steps by hand: the phase-1 checkpoint forced to token 0 of the new shard
    # (which loads weights, optimizer, carry and RNG): bitwise the same run.
    by_hand = worker_env(tmp_path / "hand", SHARD=shard2, CKPT_IN=ended, START_TOKEN=0,
                         FORCE_START_TOKEN=1, MAX_STEPS=2)
    assert run_worker(by_hand).returncode == 0
    ours, theirs = load_ckpt(switched["CKPT_OUT"]), load_ckpt(by_hand["CKPT_OUT"])
    assert ours["train_state"]["next_token"] == 2 * TOKENS_PER_STEP
    assert ours["train_state"]["phase"] == 2 and theirs["train_state"]["phase"] == 1
    for key in ("model_state", "optimizer_state"):
        assert _tensors_equal(ours[key], theirs[key]), key
    # ... and not what a fresh optimizer would give: the momentum came from phase 1.
    assert any(state["momentum_buffer"].abs().sum() > 0
               for state in phase1["optimizer_state"]["state"].values())


def test_a_checkpoint_of_another_phase_is_refused(tmp_path, phase_one):
    ended, _ = phase_one
    shard = write_synth_shard(tmp_path / "data" / "phase3.npy", tokens=4000, seed=3)
    cases = {
        "skips a phase": {"PHASE": 3, "START_TOKEN": 0},
        "not at the new phase's first token": {"PHASE": 2, "START_TOKEN": 64},
    }
    for name, settings in cases.items():
        env = worker_env(tmp_path / name.replace(" ", "_"), SHARD=shard, CKPT_IN=ended,
                         **settings)
        proc = run_worker(env)
        assert proc.returncode == 2, (name, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and "phase" in lines[0], \
            (name, proc.stderr)
        assert not (tmp_path / name.replace(" ", "_") / "checkpoints").exists(), name
