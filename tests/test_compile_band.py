"""The compiled step (inductor on the CPU) against the eager step from the same weights, RNG
and tokens, for the compiled stages' settings the CPU runs; owned by the training step
(fractus/train/step.py). Compared per step: tf, lb, grad_norm, the SS pass's CE, the
parameters after the optimizer step, and each block's MoE gates and routes (top-k experts
per row) after every forward pass.

On the presets the model is chaotic at fresh weights: the Kuramoto layer seeds its phases on
the `mod 2*pi` discontinuity and the damping term turns the wrap into a jump (docs/ENGINE.md),
so rounding alone moves the loss by ~1e-4. There the compiled step is held within NOISE_FACTOR
times the noise floor measured in the same test: the eager step from the weights perturbed
at float32 resolution (1e-7 relative). Which side of the wrap a value lands on is a coin flip
of that noise (lb takes one of two values ~1e-2 apart), so the floor is the largest over
PERTURBATIONS perturbations: one alone may land where eager did. With the damping at 0 the
ODE is 2*pi-periodic and the wrap continuous: the same perturbations move the eager step by
~1e-7, and the compiled step must match eager per step within TIGHT.

Each test compiles once with inductor (minutes on a loaded CPU): marked `inductor`, which the
plain `python -m pytest -q` deselects; .ci/run runs them in a step of their own.
"""

from __future__ import annotations

import random
import statistics
import time

import pytest
import torch

from fractus.config import PRESETS
from fractus.continuous_engine import ContinuousThoughtEngine
from fractus.nn import attention
from fractus.train.env import WorkerSettings
from fractus.train.step import TrainStep

B, SEQ, STEPS, PERTURB = 2, 16, 3, 1e-7
PERTURBATIONS = (5, 6, 7, 8)   # the seeds of the weights' perturbations
NOISE_FACTOR = 10       # compiled vs eager at most 10x the eager step's own noise floor
# The well-conditioned step, compiled vs eager, per step: relative for the scalars, the
# largest absolute difference for the parameters, about 10 float32 ulps at |p| ~ 1 (the
# rounding of a few fused ops; measured: 4e-7 and 6e-8, docs/BENCHMARKS.md).
TIGHT = {"tf": 1e-5, "lb": 1e-5, "grad_norm": 1e-5, "ss": 1e-5, "params": 1e-6}
NOISY_WELL = 1e-6       # the well-conditioned eager step's own floor stays below this

# Stage 4 (chunked CE, shipped stages.yaml); stage 5 (ACCUM 2) with SS on; dense CE (stages
# 1-2) with SS on and ACCUM 2. CE_CHUNK 24 splits the tiny vocabulary (512) into chunks. Four
# graphs in all (chunked or dense, damping or none): stage 5's is stage 4's (ACCUM and SS
# call the same chunk function with the same shapes), so inductor's cache compiles it once.
SETTINGS = [{"CE_CHUNK": "24", "SS_RATE": "0", "ACCUM": "1"},
            {"CE_CHUNK": "24", "SS_RATE": "1", "ACCUM": "2"},
            {"CE_CHUNK": "0", "SS_RATE": "1", "ACCUM": "2"}]
IDS = ["stage4", "stage5-ss", "dense-ss-accum2"]
TOP_K = PRESETS["tiny"].top_k


def _run(env: dict, perturb: int | None, compiled: bool, damping: float | None = None) -> dict:
    """STEPS steps from the seeded tiny model: per step its values and weights; per forward
    pass and block, the gates each row's route is chosen from ((passes*blocks, B, E));
    each step's seconds. `perturb`: the seed of the weights'
    perturbation (PERTURB relative), None for none."""
    torch.manual_seed(0)
    random.seed(0)
    model = ContinuousThoughtEngine.from_config(PRESETS["tiny"])
    model.reset_thought(B)
    model.set_gate_temperature(2.5)
    if damping is not None:
        for blk in model.blocks:
            blk.kuramoto.damping = damping
    if perturb is not None:
        generator = torch.Generator().manual_seed(perturb)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 + PERTURB * torch.randn(p.shape, generator=generator))
    settings = WorkerSettings.from_env({"BATCH": str(B), "SEQ": str(SEQ), **env})
    trainer = TrainStep(model, torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9),
                        settings, torch.device("cpu"))
    if compiled:
        trainer.compile()
    gates = []

    def recorded(fn):
        """fn, then the gates the pass routed by, from the phases it carried out (eager)."""
        def call(*args, **kwargs):
            out = fn(*args, **kwargs)
            with torch.no_grad():
                gates.extend(blk.moe.gates(blk.kuramoto_phases[:, -1, :]) for blk in model.blocks)
            return out
        return call

    trainer.tick, trainer.tick_ce = recorded(trainer.tick), recorded(trainer.tick_ce)
    tokens = torch.Generator().manual_seed(1)
    steps, seconds = [], []
    for step in range(1, STEPS + 1):
        batches = [(torch.randint(0, 512, (B, SEQ), generator=tokens),
                    torch.randint(0, 512, (B, SEQ), generator=tokens))
                   for _ in range(settings.accum)]
        start = time.perf_counter()
        r = trainer(batches, step)
        seconds.append(time.perf_counter() - start)
        steps.append({"tf": r.tf, "lb": r.lb, "grad_norm": r.grad_norm, "ss": r.ss,
                      "params": torch.cat([p.detach().flatten() for p in model.parameters()])})
    return {"steps": steps, "gates": torch.stack(gates), "seconds": seconds}


def _runs(env: dict, damping: float | None = None) -> tuple[dict, list[dict], dict]:
    """Eager, eager perturbed (each of PERTURBATIONS), compiled; the times printed."""
    torch._dynamo.reset()
    attention.set_attention_impl("chunked")
    try:
        eager = _run(env, None, False, damping)
        noisy = [_run(env, seed, False, damping) for seed in PERTURBATIONS]
        compiled = _run(env, None, True, damping)
    finally:
        torch._dynamo.reset()
        attention.set_attention_impl(None)
    print(f"\n{env} damping {damping}: compile (step 1) {compiled['seconds'][0]:.1f} s; "
          f"steady step compiled {statistics.median(compiled['seconds'][1:]):.4f} s, "
          f"eager {statistics.median(eager['seconds'][1:]):.4f} s")
    return eager, noisy, compiled


def _keys(env: dict) -> tuple[str, ...]:
    return ("tf", "lb", "grad_norm", "params") + (("ss",) if env["SS_RATE"] != "0" else ())


def _floor(noisy: list[dict], eager: dict, key: str) -> float:
    """The largest relative difference of `key`, any perturbed run against eager, any step."""
    return max(_rel(n[key], e[key]) for run in noisy for n, e in zip(run["steps"], eager["steps"]))


def _rel(a, b) -> float:
    if torch.is_tensor(a):
        return float((a - b).norm() / b.norm())
    return abs(a - b) / max(abs(b), 1e-12)


def _routes(run: dict) -> torch.Tensor:
    """Each decision's top-k experts (sorted ids): one per row, block and pass."""
    return run["gates"].topk(TOP_K, dim=-1).indices.sort(-1).values


def _check_routes(eager: dict, noisy: list[dict], compiled: dict) -> int:
    """The compiled gates move from eager's at most NOISE_FACTOR times the most a
    perturbation moved them (so a route flips only where noise could flip it); the number
    of route decisions that flipped."""
    assert compiled["gates"].shape == eager["gates"].shape      # the same passes ran
    floor = max(float((n["gates"] - eager["gates"]).abs().max()) for n in noisy)
    moved = float((compiled["gates"] - eager["gates"]).abs().max())
    flips = int((_routes(compiled) != _routes(eager)).any(-1).sum())
    top = eager["gates"].topk(TOP_K + 1, dim=-1).values
    gap = float((top[..., -2] - top[..., -1]).min())
    print(f"gates: compiled vs eager {moved:.2e}, noise floor {floor:.2e}; routes flipped "
          f"{flips} of {top.shape[0] * top.shape[1]} (perturbed: "
          f"{[int((_routes(n) != _routes(eager)).any(-1).sum()) for n in noisy]}); smallest "
          f"gap between eager's k-th and next gate {gap:.2e}")
    assert floor > 0 and moved <= NOISE_FACTOR * floor, (moved, floor)
    return flips


@pytest.mark.inductor
@pytest.mark.parametrize("env", SETTINGS, ids=IDS)
def test_the_compiled_step_stays_within_the_eager_steps_noise_floor(env):
    eager, noisy, compiled = _runs(env)
    for key in _keys(env):
        floor = _floor(noisy, eager, key)
        worst = max(_rel(c[key], e[key]) for c, e in zip(compiled["steps"], eager["steps"]))
        print(f"{key}: compiled vs eager {worst:.2e}, noise floor {floor:.2e}")
        assert floor > 0, key               # the perturbation reached every value
        assert worst <= NOISE_FACTOR * floor, (key, worst, floor)
    _check_routes(eager, noisy, compiled)


@pytest.mark.inductor
@pytest.mark.parametrize("env", SETTINGS, ids=IDS)
def test_on_a_well_conditioned_model_the_compiled_step_matches_eager_per_step(env):
    eager, noisy, compiled = _runs(env, damping=0.0)
    for key in _keys(env):
        floor = _floor(noisy, eager, key)
        assert floor < NOISY_WELL, (key, floor)         # the step is well-conditioned here
        for step, (c, e) in enumerate(zip(compiled["steps"], eager["steps"]), 1):
            diff = (float((c[key] - e[key]).abs().max()) if key == "params"
                    else _rel(c[key], e[key]))
            print(f"{key} step {step}: compiled vs eager {diff:.2e} (floor {floor:.2e})")
            assert diff <= TIGHT[key], (key, step, diff)
    assert _check_routes(eager, noisy, compiled) == 0
