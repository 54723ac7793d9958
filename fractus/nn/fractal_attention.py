"""Multi-level linear attention layer with a carried (S, z) state.

Level l shifts q and k by (phi^2)^-l before elu+1; levels share v and the carried state,
their outputs mix by softmax(level_logits), and the new state is their mean final state.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from .attention import linear_attention
from .stats import elu1

PHI = (1.0 + math.sqrt(5.0)) / 2.0


def heads_from_block_diagonal(S: torch.Tensor, z: torch.Tensor, n_heads: int, d_head: int):
    """(B, H*D, H*D), (B, H*D) -> per-head (B, H, D, D), (B, H, D)."""
    B = S.shape[0]
    S_heads = S.reshape(B, n_heads, d_head, n_heads, d_head).diagonal(dim1=1, dim2=3)
    return S_heads.permute(0, 3, 1, 2), z.reshape(B, n_heads, d_head)


def block_diagonal_from_heads(S_heads: torch.Tensor, z_heads: torch.Tensor):
    """Per-head (B, H, D, D), (B, H, D) -> (B, H*D, H*D) block-diagonal, (B, H*D)."""
    B, H, D, _ = S_heads.shape
    S = S_heads.new_zeros(B, H, D, H, D)
    S.diagonal(dim1=1, dim2=3).copy_(S_heads.permute(0, 2, 3, 1))
    return S.reshape(B, H * D, H * D), z_heads.reshape(B, H * D)


class FractalLinearAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, d_head: int, n_levels: int):
        super().__init__()
        self.n_heads, self.d_head, self.n_levels = n_heads, d_head, n_levels
        inner = n_heads * d_head
        self.w_qkv = nn.Parameter(torch.randn(3, d_model, inner) / math.sqrt(d_model))
        self.b_qkv = nn.Parameter(torch.zeros(3, inner))
        self.w_out = nn.Parameter(torch.randn(inner, d_model) / math.sqrt(inner))
        self.b_out = nn.Parameter(torch.zeros(d_model))
        self.level_logits = nn.Parameter(torch.zeros(n_levels))
        offsets = torch.tensor([(PHI ** 2) ** (-l) for l in range(n_levels)], dtype=torch.float32)
        self.register_buffer("level_offsets", offsets)

    def forward(self, x: torch.Tensor, S_carry: torch.Tensor, z_carry: torch.Tensor):
        """x (B, C, d), block-diagonal carry (batch B or 1) -> (output (B, C, d), new S, new
        z), the state detached."""
        B, C, _ = x.shape
        H, D, L = self.n_heads, self.d_head, self.n_levels
        qkv = [torch.einsum("bld,de->ble", x, self.w_qkv[j]) + self.b_qkv[j] for j in range(3)]
        q, k, v = (t.reshape(B, C, H, D) for t in qkv)
        offsets = self.level_offsets.view(L, 1, 1, 1)
        # (B, L, H, C, D) -> groups G = B*L*H, the layout every kernel takes.
        q_feat = elu1(q.unsqueeze(1) + offsets).permute(0, 1, 3, 2, 4).reshape(B * L * H, C, D)
        k_feat = elu1(k.unsqueeze(1) + offsets).permute(0, 1, 3, 2, 4).reshape(B * L * H, C, D)
        v_lev = v.permute(0, 2, 1, 3).unsqueeze(1).expand(B, L, H, C, D).reshape(B * L * H, C, D)

        S_heads, z_heads = heads_from_block_diagonal(S_carry, z_carry, H, D)
        S0 = S_heads.unsqueeze(1).expand(B, L, H, D, D).reshape(B * L * H, D, D)
        z0 = z_heads.unsqueeze(1).expand(B, L, H, D).reshape(B * L * H, D)
        y, (S_final, z_final) = linear_attention(q_feat, k_feat, v_lev, carry=(S0, z0))

        with torch.no_grad():
            S_new, z_new = block_diagonal_from_heads(
                S_final.reshape(B, L, H, D, D).mean(1), z_final.reshape(B, L, H, D).mean(1))

        y = y.reshape(B, L, H, C, D).permute(0, 1, 3, 2, 4).reshape(B, L, C, H * D)
        mixed = (y * torch.softmax(self.level_logits, dim=-1).view(1, L, 1, 1)).sum(1)
        return mixed @ self.w_out + self.b_out, S_new, z_new
