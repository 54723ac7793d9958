"""ContinuousThoughtEngine: the Fractus model, checkpoint-compatible with the reference.

    h -> [block 0: attn -> kuramoto -> moe] -> ... -> [block N-1] -> logits = h @ observe.weight.T

Carried from chunk to chunk: each block's attention (S, z) and Kuramoto phases, and the last
position's hidden state (`thought_state`, added to the next chunk's first position).
Parameter and buffer names match the reference exactly.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import EngineConfig
from .nn.ce import chunked_cross_entropy
from .nn.fractal_attention import FractalLinearAttention
from .nn.moe import PhaseRoutedMoE
from .nn.phase_ode import KuramotoLayer

# Buffers that hold state carried between chunks (batch-sized), by block-relative name.
BLOCK_CARRY = ("attn_S", "attn_z", "kuramoto_phases")


def check_token_ids(tokens: torch.Tensor, vocab_size: int) -> None:
    """ValueError unless `tokens` is an integer tensor of ids in [0, vocab_size). The range
    check reads values, so it runs on CPU tensors only (no device sync)."""
    if not isinstance(tokens, torch.Tensor):
        raise ValueError(f"token ids must be a torch.Tensor, got {type(tokens).__name__}")
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise ValueError(f"token ids must have an integer dtype, got {tokens.dtype}")
    # Under torch.compile the value read would break the graph; the worker checks the
    # host-side slice before the compiled step instead.
    if tokens.device.type == "cpu" and tokens.numel() and not torch.compiler.is_compiling():
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"token ids must be in [0, {vocab_size}), got values in [{lo}, {hi}]")


def _adopt_carried_shapes(module: nn.Module, state_dict, prefix: str, names) -> None:
    """Carried buffers take the incoming shapes: load_state_dict works across batch sizes."""
    for name in names:
        incoming = state_dict.get(prefix + name)
        if isinstance(incoming, torch.Tensor) and incoming.shape != getattr(module, name).shape:
            setattr(module, name, getattr(module, name).new_zeros(incoming.shape))


class CTEBlock(nn.Module):
    def __init__(self, cfg: EngineConfig):
        super().__init__()
        d, inner = cfg.d_model, cfg.n_heads * cfg.d_head
        self.attn = FractalLinearAttention(d, cfg.n_heads, cfg.d_head, cfg.n_levels)
        self.norm_attn = nn.LayerNorm(d)
        self.kuramoto = KuramotoLayer(d, cfg.n_oscillators, cfg.coupling_rank)
        self.norm_kur = nn.LayerNorm(d)
        self.moe = PhaseRoutedMoE(d, cfg.n_experts, cfg.top_k, d_ff=cfg.expert_d_ff,
                                  expert_rank=cfg.siren_rank or None)
        self.norm_moe = nn.LayerNorm(d)
        self.register_buffer("attn_S", torch.zeros(1, inner, inner))
        self.register_buffer("attn_z", torch.zeros(1, inner))
        self.register_buffer("kuramoto_phases", torch.zeros(1, 1, cfg.n_oscillators))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        _adopt_carried_shapes(self, state_dict, prefix, BLOCK_CARRY)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def reset_state(self, batch_size: int) -> None:
        like = self.attn_S
        self.attn_S = like.new_zeros(batch_size, *like.shape[1:])
        self.attn_z = self.attn_z.new_zeros(batch_size, self.attn_z.shape[1])
        self.kuramoto_phases = self.kuramoto_phases.new_zeros(batch_size, 1, self.kuramoto.N)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        attn_out, S_new, z_new = self.attn(self.norm_attn(h), self.attn_S, self.attn_z)
        h = h + attn_out
        self.attn_S, self.attn_z = S_new.to(h.dtype), z_new.to(h.dtype)

        theta = self.kuramoto(self.norm_kur(h))  # stays differentiable: it routes the MoE
        self.kuramoto_phases = theta.detach()

        # The reference routes the whole chunk with the last position's phases.
        moe_out, lb = self.moe(self.norm_moe(h), theta[:, -1:, :])
        return h + moe_out, lb


class ContinuousThoughtEngine(nn.Module):
    def __init__(self, vocab_size: int = 50257, d_model: int = 256, n_layers: int = 1,
                 n_heads: int = 4, d_head: int = 64, n_levels: int = 2, n_oscillators: int = 16,
                 coupling_rank: int = 8, n_experts: int = 8, top_k: int = 2,
                 expert_d_ff: int = 256, siren_rank: int = 32):
        super().__init__()
        cfg = EngineConfig(vocab_size=vocab_size, d_model=d_model, n_layers=n_layers,
                           n_heads=n_heads, d_head=d_head, n_levels=n_levels,
                           n_oscillators=n_oscillators, coupling_rank=coupling_rank,
                           n_experts=n_experts, top_k=top_k, expert_d_ff=expert_d_ff,
                           siren_rank=siren_rank)
        self.config = cfg
        self.observe = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(CTEBlock(cfg) for _ in range(cfg.n_layers))
        self.register_buffer("last_lb_loss", torch.tensor(0.0))
        self.confidence_head = nn.Linear(cfg.d_model, 1)
        self.output_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.output_head.weight = self.observe.weight  # tied, as in the reference
        self.salience_head = nn.Linear(cfg.d_model, 1)  # unused; kept for checkpoint compatibility
        self.register_buffer("thought_state", torch.zeros(1, 1, cfg.d_model))

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> "ContinuousThoughtEngine":
        return cls(**cfg.to_dict())

    @classmethod
    def from_checkpoint(cls, source, map_location="cpu", batch_size: int | None = None,
                        config: EngineConfig | None = None):
        """From any checkpoint (path or dict) fractus.legacy reads; `config` for files without."""
        from .legacy import load_engine  # legacy imports this module
        return load_engine(cls, source, map_location=map_location, batch_size=batch_size,
                           config=config)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        _adopt_carried_shapes(self, state_dict, prefix, ("thought_state",))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    # -- carried state -------------------------------------------------------------------
    @property
    def carried_batch_size(self) -> int:
        return self.thought_state.shape[0]

    def reset_thought(self, batch_size: int = 1) -> None:
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch size must be an int >= 1, got {batch_size!r}")
        self.thought_state = self.thought_state.new_zeros(batch_size, 1, self.config.d_model)
        for blk in self.blocks:
            blk.reset_state(batch_size)

    def carry_state(self) -> dict[str, torch.Tensor]:
        """Everything carried between chunks (detached copies), for an exact resume."""
        state = {"thought_state": self.thought_state.detach().clone()}
        for i, blk in enumerate(self.blocks):
            for name in BLOCK_CARRY:
                state[f"blocks.{i}.{name}"] = getattr(blk, name).detach().clone()
        return state

    def load_carry_state(self, state: dict[str, torch.Tensor]) -> None:
        expected = set(self.carry_state())
        if set(state) != expected:
            raise ValueError(f"carry state keys: missing {sorted(expected - set(state))}, "
                             f"unexpected {sorted(set(state) - expected)}")
        batches = {t.shape[0] for t in state.values()}
        if len(batches) != 1:
            raise ValueError(f"carry state tensors disagree on batch size: {sorted(batches)}")
        device = self.thought_state.device
        self.thought_state = state["thought_state"].detach().clone().to(device)
        for i, blk in enumerate(self.blocks):
            for name in BLOCK_CARRY:
                value = state[f"blocks.{i}.{name}"]
                if value.shape[1:] != getattr(blk, name).shape[1:] and name != "kuramoto_phases":
                    raise ValueError(f"blocks.{i}.{name}: expected shape (B, "
                                     f"{tuple(getattr(blk, name).shape[1:])}), got {tuple(value.shape)}")
                setattr(blk, name, value.detach().clone().to(device))

    def set_gate_temperature(self, temperature: float) -> None:
        if not temperature > 0:
            raise ValueError(f"gate temperature must be > 0, got {temperature}")
        for blk in self.blocks:
            blk.moe.temperature = float(temperature)

    # -- chunks ----------------------------------------------------------------------------
    def _check_obs(self, obs: torch.Tensor) -> None:
        if not isinstance(obs, torch.Tensor) or obs.dim() != 2:
            shape = tuple(obs.shape) if isinstance(obs, torch.Tensor) else type(obs).__name__
            raise ValueError(f"obs must be a (B, C) tensor of token ids, got {shape}")
        check_token_ids(obs, self.config.vocab_size)
        B = obs.shape[0]
        if self.carried_batch_size not in (1, B):
            raise ValueError(f"carried state has batch {self.carried_batch_size}, obs has batch {B}: "
                             f"call reset_thought({B}) first")

    def hidden(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One chunk through every block -> final hidden (B, C, d), summed lb; advances the
        carried state (no autograd graph kept in any buffer)."""
        self._check_obs(obs)
        h = self.observe(obs)
        first = h[:, :1, :] + self.thought_state.to(h.dtype)
        h = torch.cat([first, h[:, 1:, :]], dim=1)
        lb = h.new_zeros(())
        for blk in self.blocks:
            h, lb_block = blk(h)
            lb = lb + lb_block
        # A contiguous copy, not a view of h: the view would keep all of h alive until the
        # next chunk, and its strides (C*d, d, 1) differ from the zeros it replaces, which
        # a compiled step guards on (a recompile at the second chunk).
        self.thought_state = h[:, -1:, :].detach().contiguous()
        self.last_lb_loss = lb.detach().float()
        return h, lb

    def tick_chunk_train(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, C) ids -> logits (B, C, V) and lb, both differentiable."""
        h, lb = self.hidden(obs)
        return F.linear(h, self.observe.weight), lb

    def tick_chunk_train_ce(self, obs: torch.Tensor, targets: torch.Tensor, ce_chunk: int,
                            return_hidden: bool = False):
        """Mean CE against targets without materialising all logits; (ce, lb[, h])."""
        if not isinstance(targets, torch.Tensor) or targets.shape != obs.shape:
            got = tuple(targets.shape) if isinstance(targets, torch.Tensor) else type(targets).__name__
            raise ValueError(f"targets must have the shape of obs {tuple(obs.shape)}, got {got}")
        check_token_ids(targets, self.config.vocab_size)
        h, lb = self.hidden(obs)
        ce = chunked_cross_entropy(h, self.observe.weight, targets, ce_chunk)
        return (ce, lb, h) if return_hidden else (ce, lb)

    @torch.no_grad()
    def tick_chunk(self, obs: torch.Tensor) -> torch.Tensor:
        """Inference: logits (B, C, V) for probes and generation, carried state advanced."""
        h, _ = self.hidden(obs)
        return F.linear(h, self.observe.weight)
