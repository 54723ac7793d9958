"""Pinning the reference's rounding-noise branch of the Kuramoto encoding, for fixture tests.

Why: in the fixtures every `norm_kur` is an identity LayerNorm (weight 1, bias 0), so the
mean over d of its output, which seeds oscillator 0 as `mean * 2*pi mod 2*pi`, is exactly 0
in exact arithmetic and +-1e-9 rounding noise in float32. `mod 2*pi` is discontinuous at 0:
noise of one sign gives ~0, the other ~2*pi, and the damping term (-0.01 * theta) then moves
that oscillator by ~dt*0.01*2*pi = 0.0063 rad, which changes the routing of the chunk. Which
side the reference landed on is decided by bits below float precision, not by the function;
any kernel that rounds differently (even the reference's own einsum with another stride)
flips about half of them. So for positions where |mean| is pure noise (below 1e-5), this
helper picks the branch whose final oscillator-0 phase matches the fixture's carried phase.
Nothing else is taken from the fixture: logits, lb, S, z, every other oscillator and all
gradients are still compared. A trained checkpoint's norm_kur has moved off identity, so
production inputs are not at the discontinuity.
"""

from __future__ import annotations

import contextlib
import math

import torch

from fractus.nn.phase_ode import KuramotoLayer

TWO_PI = 2.0 * math.pi
NOISE = 1e-5


def _circular_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    d = torch.remainder(a - b, TWO_PI)
    return torch.minimum(d, TWO_PI - d)


@contextlib.contextmanager
def pinned_branches(model):
    """Yields `set_reference(phases)`: phases (n_blocks, B, C, N) the fixture's carried phases
    for the chunk about to run. Counts how many positions were re-branched in `.flips`."""
    kuramotos = [blk.kuramoto for blk in model.blocks]
    original = KuramotoLayer.forward
    state = {"ref": None, "flips": 0}

    def forward(self, hidden):
        theta0 = self.encode(hidden)
        first = original(self, hidden)
        ref = state["ref"]
        if ref is None or self not in kuramotos:
            return first
        target = ref[kuramotos.index(self)][..., 0].to(first.dtype)
        noisy = (hidden.mean(dim=-1) * TWO_PI).abs() < NOISE
        shift = torch.where(theta0[..., 0] > math.pi, -TWO_PI, TWO_PI)
        other_theta0 = theta0.clone()
        other_theta0[..., 0] = theta0[..., 0] + shift
        other = self.integrate(other_theta0)
        better = _circular_distance(other[..., 0], target) < _circular_distance(first[..., 0], target)
        use_other = (noisy & better).unsqueeze(-1)
        state["flips"] += int(use_other.sum())
        return torch.where(use_other, other, first)

    def set_reference(phases):
        state["ref"] = phases

    KuramotoLayer.forward = forward
    try:
        yield set_reference
    finally:
        KuramotoLayer.forward = original
