"""Elementwise maps shared by the engine's layers."""

import math

import torch

TWO_PI = 2.0 * math.pi


def elu1(x: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """x + 1 for x > 0, alpha * (exp(x) - 1) + 1 otherwise: the reference's two-branch form,
    so float32 rounds the same (F.elu(x) + 1 differs in the last bit for x <= 0)."""
    return torch.where(x > 0, x + 1.0, alpha * (torch.exp(x) - 1.0) + 1.0)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """The tanh approximation of GELU used by the reference experts (dense and low-rank)."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))
