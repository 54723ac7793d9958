"""Kuramoto oscillators: one RK4 step of low-rank coupled phases, seeded from the hidden state."""

import torch
import torch.nn as nn

from .stats import TWO_PI


class KuramotoLayer(nn.Module):
    """Phases theta (..., N) evolve by
    d theta = omega - damping*theta + cos(theta)*((lambda*(sin(theta)@U))@U^T)
                                    - sin(theta)*((lambda*(cos(theta)@U))@U^T).
    """

    def __init__(self, d_model: int, n_oscillators: int, coupling_rank: int,
                 n_steps: int = 1, dt: float = 0.1, damping: float = 0.01):
        super().__init__()
        self.d_model = d_model
        self.N = n_oscillators
        self.n_steps = n_steps
        self.dt = dt
        self.damping = damping
        self.omega = nn.Parameter(0.1 * torch.randn(n_oscillators))
        self.coupling_u = nn.Parameter(torch.randn(n_oscillators, coupling_rank) / n_oscillators ** 0.5)
        self.coupling_lambda = nn.Parameter(torch.full((coupling_rank,), 0.1))

    def derivative(self, theta: torch.Tensor) -> torch.Tensor:
        sin_t, cos_t = torch.sin(theta), torch.cos(theta)
        u = self.coupling_u
        pull_sin = (self.coupling_lambda * (sin_t @ u)) @ u.T
        pull_cos = (self.coupling_lambda * (cos_t @ u)) @ u.T
        return self.omega - self.damping * theta + cos_t * pull_sin - sin_t * pull_cos

    def encode(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, L, d) -> initial phases (B, L, N): the token's mean, spread by 2*pi*n/N."""
        mean_angle = hidden.mean(dim=-1) * TWO_PI
        offsets = torch.arange(self.N, dtype=hidden.dtype, device=hidden.device) / self.N * TWO_PI
        return torch.remainder(mean_angle.unsqueeze(-1) + offsets, TWO_PI)

    def integrate(self, theta: torch.Tensor) -> torch.Tensor:
        """Classic RK4, wrapped to [0, 2*pi) after every step."""
        dt = self.dt
        for _ in range(self.n_steps):
            k1 = self.derivative(theta)
            k2 = self.derivative(theta + 0.5 * dt * k1)
            k3 = self.derivative(theta + 0.5 * dt * k2)
            k4 = self.derivative(theta + dt * k3)
            theta = torch.remainder(theta + (dt / 6.0) * (k1 + 2 * k2 + 2 * k3 + k4), TWO_PI)
        return theta

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.integrate(self.encode(hidden))
