"""bf16 autocast proven on the CPU: the same setting as on CUDA, and its band against float32.

`BF16=1` runs the step under `torch.autocast(device, bfloat16)` on the CPU too (off by
default there, on by default on CUDA). Measured here, on the `tiny` engine made
well-conditioned (the Kuramoto LayerNorm's bias moved off 0, so the phases do not sit on
the `mod 2*pi` discontinuity of a fresh model, docs/ENGINE.md), over STEPS steps of the real
TrainStep from the same weights and tokens, dense and chunked CE, scheduled sampling off
(bf16 logits draw other tokens: a different input, by design): bf16 against float32 moves
tf, lb and grad_norm by at most 3.3e-4 relative (2.6e-4 on `tiny`, 3.3e-4 on `small` with
the GPT-2 vocabulary), while float32 against itself with the weights moved at float32
resolution (the noise floor, measured in the same test) moves them by < 1e-6, and no MoE
route flips. BF16_BAND keeps a 3x margin over the measurement; two bf16 runs of equal
kernels (the exact stages' canary on CUDA) are each within it of float32, so the canary's
CUDA tolerance is twice it.
"""

from __future__ import annotations

import random

import pytest
import torch

from fractus.config import PRESETS
from fractus.continuous_engine import ContinuousThoughtEngine
from fractus.nn import attention
from fractus.train.env import WorkerSettings
from fractus.train.step import TrainStep
from launcher.checks.trusted_loss import shipped_criteria_file

BF16_BAND = 1e-3        # relative, per step, for tf, lb and grad_norm (3x the measured)
FLOOR_LIMIT = 1e-5      # the well-conditioned floor must sit far below the band
STEPS = 6
BATCH, SEQ = 4, 32


@pytest.fixture(autouse=True)
def chunked_attention():
    attention.set_attention_impl("chunked")
    yield
    attention.set_attention_impl(None)


def _engine(perturb: bool = False) -> ContinuousThoughtEngine:
    torch.manual_seed(0)
    model = ContinuousThoughtEngine.from_config(PRESETS["tiny"])
    with torch.no_grad():
        for blk in model.blocks:     # phases off the mod-2*pi discontinuity: well-conditioned
            blk.norm_kur.bias.fill_(0.5 / blk.kuramoto.N)
        if perturb:                  # the noise floor: weights moved at float32 resolution
            generator = torch.Generator().manual_seed(7)
            for p in model.parameters():
                p.mul_(1 + 1.2e-7 * torch.randn(p.shape, generator=generator))
    model.reset_thought(BATCH)
    model.set_gate_temperature(2.5)
    return model


def _run(model, ce_chunk: int, bf16: str | None, data):
    """Per step (tf, lb, grad_norm), and every MoE routing decision (top-k indices)."""
    routes = []
    for blk in model.blocks:
        select = blk.moe.select

        def recording(g, select=select):
            weights, idx = select(g)
            routes.append(idx.detach().clone())
            return weights, idx
        blk.moe.select = recording
    env = {"BATCH": str(BATCH), "SEQ": str(SEQ), "SS_RATE": "0", "CE_CHUNK": str(ce_chunk)}
    if bf16 is not None:
        env["BF16"] = bf16
    random.seed(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=7e-4, momentum=0.9)
    trainer = TrainStep(model, optimizer, WorkerSettings.from_env(env), torch.device("cpu"))
    results = [trainer([batch], step) for step, batch in enumerate(data, start=1)]
    return [(r.tf, r.lb, r.grad_norm) for r in results], routes


def _data():
    generator = torch.Generator().manual_seed(5)
    return [(torch.randint(0, 512, (BATCH, SEQ), generator=generator),
             torch.randint(0, 512, (BATCH, SEQ), generator=generator)) for _ in range(STEPS)]


def _worst(run, reference) -> float:
    return max(abs(a - b) / abs(b) for row, ref in zip(run, reference) for a, b in zip(row, ref))


def test_bf16_is_the_same_setting_on_the_cpu_and_off_by_default_there():
    obs, target = _data()[0]
    for bf16, dtype in ((None, torch.float32), ("0", torch.float32), ("1", torch.bfloat16)):
        env = {"BATCH": str(BATCH), "SEQ": str(SEQ), "CE_CHUNK": "0"}
        if bf16 is not None:
            env["BF16"] = bf16
        model = _engine()
        trainer = TrainStep(model, torch.optim.SGD(model.parameters(), lr=1e-3),
                            WorkerSettings.from_env(env), torch.device("cpu"))
        _, _, logits = trainer._forward(obs, target, want_sampling=True, step=1)
        assert logits.dtype == dtype, bf16
    cuda = TrainStep(model, torch.optim.SGD(model.parameters(), lr=1e-3),
                     WorkerSettings.from_env({}), torch.device("cuda"))
    assert cuda.bf16      # the CUDA default stays v1's (device not touched: a property)


@pytest.mark.parametrize("ce_chunk", [0, 48], ids=["dense_ce", "chunked_ce"])
def test_bf16_stays_within_its_band_of_float32(ce_chunk):
    data = _data()
    fp32, fp32_routes = _run(_engine(), ce_chunk, None, data)
    bf16, bf16_routes = _run(_engine(), ce_chunk, "1", data)
    floor, floor_routes = _run(_engine(perturb=True), ce_chunk, None, data)
    assert _worst(floor, fp32) < FLOOR_LIMIT           # the configuration is well-conditioned
    worst = _worst(bf16, fp32)
    assert 0 < worst <= BF16_BAND, worst               # bf16 ran, and within its band
    assert len(bf16_routes) == len(fp32_routes) == STEPS * PRESETS["tiny"].n_layers
    for got, want, noise in zip(bf16_routes, fp32_routes, floor_routes):
        assert torch.equal(noise, want)
        assert torch.equal(got, want)                  # no route flips


def test_the_canary_tolerance_on_cuda_is_twice_the_measured_bf16_band():
    tolerance = shipped_criteria_file().canary.exact["cuda"]
    assert tolerance.rtol == pytest.approx(2 * BF16_BAND) and tolerance.atol == 0
