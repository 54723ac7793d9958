"""ACCUM=1 with CE_CHUNK=0 is the reference v1 step, bit for bit.

The reference loop (tests/support/v1_step.py) is transcribed from MODEL.md, independently of
fractus/train: the same seed, the same engine, SGD(momentum 0.9) with its own zero_grad /
backward / clip 1.0 / step per pass, the SS coin from python `random`, then the multinomial
draw, then `torch.rand(B, SEQ)` for the mask. The worker runs as a real subprocess on the
same checkpoint and shard; the weights, momentum buffers and EMA must be identical.
"""

import random

import numpy as np
import torch

from tests.support.v1_step import V1Settings
from tests.support.v1_step import reference_loop as v1_loop
from tests.support.worker_utils import (events, load_ckpt, read_jsonl, run_worker, worker_env,
                                        write_synth_shard)

B, SEQ, LR, SS_RATE, SS_PROB, LB_COEF, GATE_TEMP, SEED = 2, 16, 0.05, 0.5, 0.2, 0.02, 2.5, 1234
START, STEPS = 37, 6  # 37 is not a multiple of B*SEQ: the worker must not round it


def legacy_checkpoint(path):
    """A v1-style weights-only file from a fresh tiny engine (carried state at batch B)."""
    from fractus.config import PRESETS
    from fractus.continuous_engine import ContinuousThoughtEngine
    torch.manual_seed(0)
    model = ContinuousThoughtEngine(**PRESETS["tiny"].to_dict())
    model.reset_thought(B)
    with torch.no_grad():  # give the carried state something non-zero to carry
        model.tick_chunk(torch.randint(0, 512, (B, SEQ)))
    torch.save({"model_state": model.state_dict(),
                "config": {**PRESETS["tiny"].to_dict(), "gpu": 0, "batch": B}}, path)


def reference_loop(ckpt_path, tokens: torch.Tensor):
    from fractus.continuous_engine import ContinuousThoughtEngine
    torch.manual_seed(SEED)
    random.seed(SEED)
    eng = ContinuousThoughtEngine.from_checkpoint(str(ckpt_path))
    eng.set_gate_temperature(GATE_TEMP)
    opt = torch.optim.SGD(eng.parameters(), lr=LR, momentum=0.9)
    run = v1_loop(eng, opt, tokens, START, STEPS,
                  V1Settings(B, SEQ, LR, SS_RATE, SS_PROB, LB_COEF))
    return eng, opt, run.next_token, run.ema_tf, run.ema_ss, run.ss_passes


def test_worker_step_is_the_reference_step(tmp_path):
    shard = write_synth_shard(tmp_path / "shard.npy", tokens=START + STEPS * B * SEQ + 100)
    legacy_checkpoint(tmp_path / "legacy.pt")
    env = worker_env(tmp_path, CKPT_IN=tmp_path / "legacy.pt", START_TOKEN=START,
                     MAX_STEPS=STEPS, LR=LR, SS_RATE=SS_RATE, SS_PROB=SS_PROB, LB_COEF=LB_COEF,
                     GATE_TEMP=GATE_TEMP, SEED=SEED, CE_CHUNK=0, ACCUM=1, BATCH=B, SEQ=SEQ)
    proc = run_worker(env)
    assert proc.returncode == 0, proc.stderr

    torch.set_num_threads(1)  # the worker ran with one thread too
    tokens = torch.from_numpy(np.load(shard).astype(np.int64))
    eng, opt, p, ema_tf, ema_ss, ss_passes = reference_loop(tmp_path / "legacy.pt", tokens)
    assert 0 < ss_passes < STEPS  # both branches of the step ran

    ck = load_ckpt(env["CKPT_OUT"])
    ts = ck["train_state"]
    assert ts["next_token"] == p == START + STEPS * B * SEQ and ts["step"] == STEPS
    assert ts["ema_tf"] == ema_tf and ts["ema_ss"] == ema_ss
    ref_state = eng.state_dict()
    assert set(ck["model_state"]) == set(ref_state)
    for name, value in ref_state.items():
        assert torch.equal(ck["model_state"][name], value), name
    ref_opt = opt.state_dict()
    for idx, state in ref_opt["state"].items():
        assert torch.equal(ck["optimizer_state"]["state"][idx]["momentum_buffer"],
                           state["momentum_buffer"]), idx
    # the legacy file had weights only: the worker said momentum and RNG restart
    warnings = events(read_jsonl(env["METRICS"]), "warning")
    assert any("momentum" in w["message"] for w in warnings)
