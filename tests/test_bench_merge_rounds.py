"""benchmarks/bench_merge_rounds.py at a few steps, through the launcher's outer step: its
arms run, `mean` equals `nesterov` at lr 1, momentum 0, and lr 0.7, momentum 0.9 moves
elsewhere."""

import torch

from benchmarks.bench_merge_rounds import Setup, run_seed
from launcher.hub.outer_step import OuterSettings

SMALL = Setup(workers=2, rounds=2, steps=2, batch=2, seq=8, heldout_rows=2, heldout_len=16)


def test_mean_is_nesterov_at_lr1_momentum0_and_momentum_moves_elsewhere():
    # Two rounds: round 1 sets outer := mean in every arm; round 2 is the first outer step.
    res = run_seed(SMALL, seed=0, outer_arms={
        "mean": OuterSettings("mean"), "corner": OuterSettings("nesterov", 1.0, 0.0),
        "nesterov": OuterSettings("nesterov", 0.7, 0.9)})
    final = res["final"]
    assert set(final["mean"]) == set(final["corner"]) == set(final["none"]) and final["mean"]
    assert all(torch.equal(final["corner"][k], final["mean"][k]) for k in final["mean"])
    assert res["corner"] == res["mean"]
    # the same first round everywhere, then a different step with momentum
    assert res["nesterov"][0] == res["mean"][0] == res["none"][0]
    assert not all(torch.equal(final["nesterov"][k], final["mean"][k]) for k in final["mean"])
    for arm in ("none", "none_each", "mean", "nesterov"):
        assert len(res[arm]) == 2 and all(x > 0 for x in res[arm])
