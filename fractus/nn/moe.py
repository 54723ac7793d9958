"""Phase-routed mixture of experts: von Mises gates around Farey expert phases.

Phases (B, 1, N) (the engine's: a chunk's last position) take "row" dispatch, per-token
phases (B, L, N) the reference's "token" dispatch; same function (docs/ENGINE.md, "Where
the time went").
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from .farey import expert_phases
from .stats import gelu_tanh

KAPPA = 4.0


class PhaseRoutedMoE(nn.Module):
    def __init__(self, d_model: int, n_experts: int, top_k: int, kappa: float = KAPPA,
                 temperature: float = 1.0, d_ff: int = 64, expert_rank: int | None = None):
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k must be in [1, {n_experts}], got {top_k}")
        self.d_model, self.n_experts, self.top_k = d_model, n_experts, top_k
        self.kappa, self.temperature = kappa, temperature
        self.d_ff, self.expert_rank = d_ff, expert_rank
        # "auto" picks row dispatch when the phases allow it; "token" forces the reference path.
        self.dispatch = "auto"
        self.register_buffer("expert_phases", torch.tensor(expert_phases(n_experts), dtype=torch.float32))

        E, D, F = n_experts, d_model, d_ff

        def uniform(*shape, bound):
            return nn.Parameter(torch.empty(*shape).uniform_(-bound, bound))

        if expert_rank is None:
            self.w1 = uniform(E, D, F, bound=math.sqrt(2.0 / D))
            self.b1 = nn.Parameter(torch.zeros(E, F))
            self.w2 = uniform(E, F, D, bound=math.sqrt(2.0 / F))
            self.b2 = nn.Parameter(torch.zeros(E, D))
        else:
            R = expert_rank
            self.U1 = uniform(E, F, R, bound=math.sqrt(2.0 / (F + R)))
            self.V1 = uniform(E, D, R, bound=math.sqrt(2.0 / (D + R)))
            self.U2 = uniform(E, D, R, bound=math.sqrt(2.0 / (D + R)))
            self.V2 = uniform(E, F, R, bound=math.sqrt(2.0 / (F + R)))
            self.scale1 = nn.Parameter(torch.ones(E, 1, 1))
            self.scale2 = nn.Parameter(torch.ones(E, 1, 1))
            self.b1 = nn.Parameter(torch.zeros(E, F))
            self.b2 = nn.Parameter(torch.zeros(E, D))

    # -- routing -------------------------------------------------------------------------
    def gates(self, phases: torch.Tensor) -> torch.Tensor:
        """(..., N) oscillator phases -> (..., E) normalised von Mises gates."""
        mean_phase = torch.atan2(torch.sin(phases).sum(-1), torch.cos(phases).sum(-1))
        g = torch.exp((self.kappa / self.temperature) * torch.cos(mean_phase.unsqueeze(-1) - self.expert_phases))
        total = g.sum(-1, keepdim=True)
        return torch.where(total > 1e-10, g / total, torch.full_like(g, 1.0 / self.n_experts))

    def select(self, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k experts and their weights, renormalised to sum to one."""
        vals, idx = g.topk(self.top_k, dim=-1)
        total = vals.sum(-1, keepdim=True)
        weights = torch.where(total > 1e-10, vals / total, torch.full_like(vals, 1.0 / self.top_k))
        return weights, idx

    def load_balance(self, g: torch.Tensor) -> torch.Tensor:
        P = g.mean(dim=(0, 1))
        return self.n_experts * ((P - 1.0 / self.n_experts) ** 2).sum()

    # -- experts ---------------------------------------------------------------------------
    def _gathered(self, idx: torch.Tensor) -> dict[str, torch.Tensor]:
        """Parameters of the experts named by idx (any shape), stacked in idx's shape."""
        flat = idx.reshape(-1)
        names = ("w1", "b1", "w2", "b2") if self.expert_rank is None else \
            ("U1", "V1", "U2", "V2", "scale1", "scale2", "b1", "b2")
        return {n: getattr(self, n).index_select(0, flat).reshape(*idx.shape, *getattr(self, n).shape[1:])
                for n in names}

    def _experts(self, x: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
        """x (..., L, D) through experts whose parameters p carry the same leading dims."""
        if self.expert_rank is None:
            a1 = gelu_tanh(x @ p["w1"] + p["b1"].unsqueeze(-2))
            return a1 @ p["w2"] + p["b2"].unsqueeze(-2)
        a1 = p["scale1"] * ((x @ p["V1"]) @ p["U1"].transpose(-1, -2)) + p["b1"].unsqueeze(-2)
        a1 = gelu_tanh(a1)
        return p["scale2"] * ((a1 @ p["V2"]) @ p["U2"].transpose(-1, -2)) + p["b2"].unsqueeze(-2)

    def _all_experts(self, x: torch.Tensor) -> torch.Tensor:
        """(N, D) -> (N, E, D): every expert on every token."""
        every = torch.arange(self.n_experts, device=x.device)
        return self._experts(x.unsqueeze(0), self._gathered(every)).transpose(0, 1)

    # -- forward ---------------------------------------------------------------------------
    def forward(self, h: torch.Tensor, phases: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h (B, L, D), phases (B, 1, N) or (B, L, N) -> (output (B, L, D), lb loss)."""
        B, L, D = h.shape
        g = self.gates(phases)
        weights, idx = self.select(g)
        lb = self.load_balance(g.expand(B, L, self.n_experts))
        if phases.shape[1] == 1 and self.dispatch == "auto":
            # Row dispatch: each row's K experts over all its tokens, (B, K, L, D).
            out = self._experts(h.unsqueeze(1), self._gathered(idx[:, 0]))
            mixed = (weights[:, 0, :, None, None] * out).sum(1)
            return mixed, lb
        if phases.shape[1] == 1:
            weights, idx = weights.expand(B, L, -1), idx.expand(B, L, -1)
        x = h.reshape(B * L, D)
        flat_idx = idx.reshape(B * L, self.top_k)
        if self.n_experts > 2 * self.top_k:
            # Gather-first: each token's K experts, (B*L, K, 1, D).
            out = self._experts(x[:, None, None, :], self._gathered(flat_idx)).squeeze(-2)
        else:
            out = torch.gather(self._all_experts(x), 1, flat_idx.unsqueeze(-1).expand(-1, -1, D))
        mixed = (weights.reshape(B * L, self.top_k, 1) * out).sum(1)
        return mixed.reshape(B, L, D), lb
