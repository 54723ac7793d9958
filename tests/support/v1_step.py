"""The reference (v1) training loop, transcribed from MODEL.md ("The training step")
independently of fractus/train: per step a TF pass with its own zero_grad / backward /
clip 1.0 / SGD step, then, when python `random` says so, the SS pass (multinomial at
temperature 0.9, then `torch.rand(B, SEQ)` for the mask, never column 0) with its own step.
On CUDA both passes run under bf16 autocast (v1's setting).

Used by tests/test_worker_reference.py (bit for bit on the CPU) and by
benchmarks/gpu_ladder.py (stage 1's ema_tf against this loop on the same GPU).
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

# v1's code computes the EMA weight as (1 - 0.98), one ulp away from the 0.02 of MODEL.md;
# the reference code wins, and the worker's EMA continues v1's curve bit for bit.
EMA_BETA = 0.98


@dataclass(frozen=True)
class V1Settings:
    batch: int
    seq: int
    lr: float = 7e-4
    ss_rate: float = 0.25
    ss_prob: float = 0.2
    lb_coef: float = 0.02


@dataclass
class V1Run:
    next_token: int
    ema_tf: float | None = None
    ema_ss: float | None = None
    ss_passes: int = 0
    ema_tf_per_step: list = field(default_factory=list)


def _pass(eng, opt, inputs, target, autocast, loss_weight: float, lb_coef: float):
    """One v1 pass: forward, CE, its own zero_grad / backward / clip 1.0 / SGD step."""
    with autocast:
        logits, lb = eng.tick_chunk_train(inputs)
        ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))
    loss = loss_weight * ce + lb_coef * lb
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(eng.parameters(), 1.0)
    opt.step()
    return logits, ce.item()


def _ema(ema: float | None, x: float) -> float:
    return x if ema is None else EMA_BETA * ema + (1 - EMA_BETA) * x


def reference_loop(eng, opt, tokens: torch.Tensor, start: int, steps: int, s: V1Settings,
                   device: torch.device = torch.device("cpu")) -> V1Run:
    """`steps` v1 steps of `eng`/`opt` on `tokens` from token `start` (the caller seeds)."""
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                else contextlib.nullcontext())
    run, b, seq = V1Run(start), s.batch, s.seq
    for _ in range(steps):
        p = run.next_token
        chunk = tokens[p:p + b * seq].view(b, seq).to(device)
        target = tokens[p + 1:p + b * seq + 1].view(b, seq).to(device)
        logits, ce = _pass(eng, opt, chunk, target, autocast, 1.0, s.lb_coef)
        run.ema_tf = _ema(run.ema_tf, ce)
        run.ema_tf_per_step.append(run.ema_tf)
        if random.random() < s.ss_rate:
            run.ss_passes += 1
            with torch.no_grad():
                probs = torch.softmax(logits.detach().float().reshape(-1, logits.size(-1)) / 0.9,
                                      -1)
                sampled = torch.multinomial(probs, 1).view(b, seq)
            use = torch.rand(b, seq, device=device) < s.ss_prob
            use[:, 0] = False
            prev = torch.cat([chunk[:, :1], sampled[:, :-1]], dim=1)
            mixed = torch.where(use, prev, chunk)
            _, ce2 = _pass(eng, opt, mixed, target, autocast, 0.5, s.lb_coef)
            run.ema_ss = _ema(run.ema_ss, ce2)
        run.next_token = p + b * seq
    return run
