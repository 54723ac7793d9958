"""Causal, inclusive, normalised linear attention with a carried state, three exact kernels.

For every group g and position t (the current token included), with carry (S0, z0):

    S_t = S0 + sum_{j<=t} k[j] (outer) v[j]     z_t = z0 + sum_{j<=t} k[j]
    y_t = (q[t] @ S_t) / (q[t] . z_t + 1e-20)   where |q[t] . z_t| > 1e-10, else 0

`linear_attention` returns `(y, (S_C, z_C))`, the carry included; q and k arrive
feature-mapped (elu + 1). Kernels (docs/ENGINE.md, "Where the time went"): "einsum" is the
ground truth, the reference's masked matmul and the speed goals' baseline; "cumsum" prefix
sums; "chunked" memory-flat blocks, whose running (S, z) is read BEFORE a block adds itself.

Numerics: bf16/fp16 inputs are computed in float32 with autocast off; y returns in the
inputs' dtype, the state in float32 (or the carry's dtype if wider). NaN/Inf propagate.
Through a masked matmul's 0 * NaN, a NaN at position j also reaches earlier rows of its
block (chunked) or chunk (einsum, as the reference); cumsum keeps it to positions >= j.
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable, Iterator, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

DEN_EPS = 1e-20  # added to the denominator, as in the reference
DEN_ZERO = 1e-10  # |den| <= DEN_ZERO gives y = 0, as in the reference
CHUNK_BLOCK = 64  # positions per block of the chunked kernel
ENV_VAR = "FRACTUS_ATTN_IMPL"

# A kernel maps (q, k, v, S0, z0) -> (y, S, z): (G, C, D) x3, (G, D, D), (G, D) in, all in one
# floating dtype, carry always a tensor (zeros when there is none).
Kernel = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tuple[Tensor, Tensor, Tensor]]
Carry = Tuple[Tensor, Tensor]


def _normalise(num: Tensor, den: Tensor) -> Tensor:
    """y = num / (den + 1e-20) where |den| > 1e-10, else 0; a NaN den propagates, and
    discarded entries divide by 1, so their branch puts no inf/NaN in the gradient."""
    keep = ~(den.abs() <= DEN_ZERO)
    safe_den = torch.where(keep, den, torch.ones_like(den))
    return torch.where(keep.unsqueeze(-1), num / (safe_den + DEN_EPS).unsqueeze(-1), 0.0)


def einsum_attention(q: Tensor, k: Tensor, v: Tensor, S0: Tensor, z0: Tensor):
    """Reference kernel: lower-triangular mask matmul over (G, C, D, D) outer products."""
    C = q.shape[1]
    causal = torch.ones(C, C, dtype=q.dtype, device=q.device).tril()  # causal[t, s] = s <= t
    kv = torch.einsum("gsa,gsb->gsab", k, v)
    S = S0.unsqueeze(1) + torch.einsum("ts,gsab->gtab", causal, kv)
    z = z0.unsqueeze(1) + torch.einsum("ts,gsa->gta", causal, k)
    num = torch.einsum("gta,gtab->gtb", q, S)
    den = torch.einsum("gta,gta->gt", q, z)
    return _normalise(num, den), S[:, -1], z[:, -1]


def cumsum_attention(q: Tensor, k: Tensor, v: Tensor, S0: Tensor, z0: Tensor):
    """Prefix sums over positions: O(C D^2) work, (G, C, D, D) memory."""
    kv = k.unsqueeze(-1) * v.unsqueeze(-2)
    S = S0.unsqueeze(1) + kv.cumsum(dim=1)
    z = z0.unsqueeze(1) + k.cumsum(dim=1)
    num = torch.matmul(q.unsqueeze(-2), S).squeeze(-2)
    den = (q * z).sum(dim=-1)
    return _normalise(num, den), S[:, -1], z[:, -1]


def _causal_mask(n: int, device: torch.device) -> Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()  # [t, j]: j <= t


class _ChunkedAttention(torch.autograd.Function):
    """Hand-written backward: keeps the inputs, y, 1/den and each block's incoming state
    (autograd: ~10 block-sized intermediates per block), recomputes in-block scores. Blocks
    are computed contiguous, then copied: a bmm into a strided slice is ~3x slower on CPU."""

    @staticmethod
    def forward(ctx, q, k, v, S0, z0, block):
        G, C, D = q.shape
        y = q.new_empty(G, C, D)
        inv_den = q.new_empty(G, C)
        S, z = S0, z0
        states_S, states_z = [], []
        for start in range(0, C, block):
            sl = slice(start, start + block)
            qb, kb, vb = q[:, sl], k[:, sl], v[:, sl]
            states_S.append(S)
            states_z.append(z)
            scores = torch.bmm(qb, kb.transpose(1, 2))
            scores.masked_fill_(~_causal_mask(qb.shape[1], q.device), 0.0)
            # Read the state of the previous blocks first; the scores add the current token.
            num = torch.bmm(scores, vb).baddbmm_(qb, S)
            den = torch.bmm(qb, z.unsqueeze(-1)).squeeze(-1).add_(scores.sum(dim=-1))
            del scores
            keep = ~(den.abs() <= DEN_ZERO)  # as in _normalise
            safe_den = torch.where(keep, den, torch.ones_like(den)).add_(DEN_EPS)
            y[:, sl] = num.div_(safe_den.unsqueeze(-1)).masked_fill_(~keep.unsqueeze(-1), 0.0)
            inv_den[:, sl] = safe_den.reciprocal_().masked_fill_(~keep, 0.0)
            S = torch.baddbmm(S, kb.transpose(1, 2), vb)
            z = z + kb.sum(dim=1)
        ctx.block = block
        ctx.save_for_backward(q, k, v, y, inv_den, *states_S, *states_z)
        return y, S, z

    @staticmethod
    @once_differentiable  # no double backward (in-place work); says so clearly if asked
    def backward(ctx, grad_y, grad_S, grad_z):
        q, k, v, y, inv_den, *states = ctx.saved_tensors
        n_blocks = len(states) // 2
        block = ctx.block
        # y = num / den where kept (inv_den = 1/den there, 0 elsewhere).
        g_den_all = (grad_y * y).sum(dim=-1).mul_(inv_den).neg_()
        gq, gk, gv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        gS, gz = grad_S, grad_z  # gradients w.r.t. the state AFTER the current block
        for b in reversed(range(n_blocks)):
            sl = slice(b * block, (b + 1) * block)
            qb, kb, vb = q[:, sl], k[:, sl], v[:, sl]
            Sb, zb, g_den = states[b], states[n_blocks + b], g_den_all[:, sl]
            g_num = grad_y[:, sl] * inv_den[:, sl].unsqueeze(-1)
            mask_out = ~_causal_mask(qb.shape[1], q.device)
            # num = scores @ vb + qb @ Sb,  den = scores @ 1 + qb . zb
            g_scores = torch.baddbmm(g_den.unsqueeze(-1), g_num, vb.transpose(1, 2))
            g_scores.masked_fill_(mask_out, 0.0)
            gq[:, sl] = (torch.bmm(g_scores, kb).baddbmm_(g_num, Sb.transpose(1, 2))
                         .addcmul_(g_den.unsqueeze(-1), zb.unsqueeze(1)))
            # state after the block = (Sb + kb^T vb, zb + sum_t kb[t])
            gk[:, sl] = (torch.bmm(g_scores.transpose(1, 2), qb)
                         .baddbmm_(vb, gS.transpose(1, 2)).add_(gz.unsqueeze(1)))
            del g_scores
            scores = torch.bmm(qb, kb.transpose(1, 2)).masked_fill_(mask_out, 0.0)
            gv[:, sl] = torch.bmm(scores.transpose(1, 2), g_num).baddbmm_(kb, gS)
            del scores
            gS = torch.baddbmm(gS, qb.transpose(1, 2), g_num)
            gz = gz + torch.bmm(qb.transpose(1, 2), g_den.unsqueeze(-1)).squeeze(-1)
        return gq, gk, gv, gS, gz, None


def chunked_attention(q: Tensor, k: Tensor, v: Tensor, S0: Tensor, z0: Tensor,
                      block: int = CHUNK_BLOCK):
    """A python loop over blocks, batched over groups (on CPU it beats a cumsum over all
    block states; the hand-written backward beats autograd's). Differentiable once."""
    if block < 1:
        raise ValueError(f"chunked attention: block must be >= 1, got {block}")
    return _ChunkedAttention.apply(q, k, v, S0, z0, block)


# --- registry and run-time choice -------------------------------------------------------------

_BUILTIN_KERNELS: dict = {
    "einsum": einsum_attention,
    "cumsum": cumsum_attention,
    "chunked": chunked_attention,
}
_kernels: dict = dict(_BUILTIN_KERNELS)
ATTENTION_IMPLS: Tuple[str, ...] = tuple(_kernels)  # rebuilt when a kernel is (un)registered

_explicit_choice: Optional[str] = None  # set_attention_impl(name)
_env_choice: Optional[str] = None  # FRACTUS_ATTN_IMPL, read lazily once
_env_read = False


def _unknown(name: object, source: str) -> ValueError:
    return ValueError(f"unknown attention impl {name!r} ({source}); "
                      f"expected one of: {', '.join(ATTENTION_IMPLS)}")


def _refresh_names() -> None:
    global ATTENTION_IMPLS
    ATTENTION_IMPLS = tuple(_kernels)


def register_attention_impl(name: str, fn: Kernel) -> None:
    """Make `fn(q, k, v, S0, z0) -> (y, S, z)` selectable as `name` (re-registering replaces)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"attention impl name must be a non-empty string, got {name!r}")
    if name in _BUILTIN_KERNELS:
        raise ValueError(f"attention impl {name!r} is built in and cannot be replaced")
    if not callable(fn):
        raise ValueError(f"attention impl {name!r}: expected a callable kernel, got {type(fn)}")
    _kernels[name] = fn
    _refresh_names()


def unregister_attention_impl(name: str) -> None:
    """Remove a registered kernel; a global choice that named it returns to automatic."""
    global _explicit_choice, _env_choice, _env_read
    if name in _BUILTIN_KERNELS:
        raise ValueError(f"attention impl {name!r} is built in and cannot be removed")
    if name not in _kernels:
        raise _unknown(name, "unregister_attention_impl")
    del _kernels[name]
    _refresh_names()
    if _explicit_choice == name:
        _explicit_choice = None
    if _env_choice == name:
        _env_choice, _env_read = None, False


def set_attention_impl(name: Optional[str]) -> None:
    """Kernel for later impl=None calls; None: automatic (FRACTUS_ATTN_IMPL, re-read at next
    use, else the device default)."""
    global _explicit_choice, _env_choice, _env_read
    if name is None:
        _explicit_choice, _env_choice, _env_read = None, None, False
        return
    if name not in _kernels:
        raise _unknown(name, "set_attention_impl")
    _explicit_choice = name


@contextlib.contextmanager
def use_attention_impl(name: str) -> Iterator[None]:
    """Use `name` for impl=None inside the block, then restore the previous choice exactly
    (an automatic choice stays automatic)."""
    global _explicit_choice
    saved = _explicit_choice
    set_attention_impl(name)
    try:
        yield
    finally:
        _explicit_choice = saved


def default_impl_for(device_type: str) -> str:
    """The kernel impl=None uses on a device of this type when nothing was chosen."""
    # Measured: on CPU the prefix sums are the user's validated default; on CUDA the blocked
    # kernel is both the fastest and the only memory-flat one.
    return "chunked" if device_type == "cuda" else "cumsum"


def get_attention_impl(device: Union[str, torch.device, None] = None) -> str:
    """The kernel that impl=None uses on `device` (default: cuda if available, else cpu)."""
    global _env_choice, _env_read
    if _explicit_choice is not None:
        return _explicit_choice
    if not _env_read:
        value = os.environ.get(ENV_VAR, "").strip()
        if value and value not in _kernels:
            raise _unknown(value, f"environment variable {ENV_VAR}")
        _env_choice, _env_read = (value or None), True
    if _env_choice is not None:
        return _env_choice
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return default_impl_for(torch.device(device).type)


# --- functional entry point --------------------------------------------------------------------

def _shape(t: Tensor) -> str:
    return "(" + ", ".join(str(s) for s in t.shape) + ")"


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, carry: Optional[Sequence[Tensor]]) -> None:
    named = [("q", q), ("k", k), ("v", v)]
    if carry is not None:
        if not isinstance(carry, (tuple, list)) or len(carry) != 2:
            raise ValueError(f"linear_attention: carry must be None or a pair (S0, z0), "
                             f"got {type(carry).__name__}")
        named += [("carry S0", carry[0]), ("carry z0", carry[1])]
    for name, t in named:
        if not isinstance(t, Tensor):
            raise ValueError(f"linear_attention: {name} must be a tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise ValueError(f"linear_attention: {name} must be floating point, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"linear_attention: {name} is on {t.device}, expected {q.device} "
                             f"(the device of q)")
    if q.dim() != 3 or q.shape[1] < 1:
        raise ValueError(f"linear_attention: expected q of shape (G, C, D) with C >= 1, "
                         f"got {_shape(q)}")
    G, C, D = q.shape
    expected = {"k": (G, C, D), "v": (G, C, D), "carry S0": (G, D, D), "carry z0": (G, D)}
    for name, t in named[1:]:
        if tuple(t.shape) != expected[name]:
            raise ValueError(f"linear_attention: expected {name} of shape {expected[name]} "
                             f"(q is (G, C, D) = {(G, C, D)}), got {_shape(t)}")


def _check_outputs(name: str, y: Tensor, S: Tensor, z: Tensor, q: Tensor) -> None:
    # Guards registered kernels; shape checks only, so no device sync.
    G, C, D = q.shape
    for what, t, want in (("y", y, (G, C, D)), ("S", S, (G, D, D)), ("z", z, (G, D))):
        if tuple(t.shape) != want:
            raise ValueError(f"attention impl {name!r} returned {what} of shape {_shape(t)}, "
                             f"expected {want}")


def linear_attention(q: Tensor, k: Tensor, v: Tensor, carry: Optional[Carry] = None,
                     impl: Optional[str] = None) -> Tuple[Tensor, Carry]:
    """(G, C, D) tensors -> (y, (S, z)); differentiable in q, k, v, carry. ValueError, before
    any computation, on an unknown impl or bad shapes/dtypes."""
    if impl is None:
        impl = get_attention_impl(q.device if isinstance(q, Tensor) else None)
    elif impl not in _kernels:
        raise _unknown(impl, "impl=")
    kernel = _kernels[impl]
    _check_inputs(q, k, v, carry)

    out_dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    compute_dtype = out_dtype
    if carry is not None:
        for t in carry:
            compute_dtype = torch.promote_types(compute_dtype, t.dtype)
    if compute_dtype in (torch.float16, torch.bfloat16):
        compute_dtype = torch.float32  # long sums in half precision lose the small terms

    G, C, D = q.shape
    if carry is None:
        S0 = q.new_zeros((G, D, D), dtype=compute_dtype)
        z0 = q.new_zeros((G, D), dtype=compute_dtype)
    else:
        S0, z0 = carry[0].to(compute_dtype), carry[1].to(compute_dtype)
    # Devices without autocast (meta: the 1B shapes traced without memory) have none to stop.
    # A compiled step runs on a real device, and dynamo before torch 2.13 cannot trace the
    # availability check (a graph break): it is asked only outside a compile.
    no_autocast = (torch.autocast(device_type=q.device.type, enabled=False)
                   if torch.compiler.is_compiling()
                   or torch.amp.is_autocast_available(q.device.type) else contextlib.nullcontext())
    with no_autocast:
        y, S, z = kernel(q.to(compute_dtype), k.to(compute_dtype), v.to(compute_dtype), S0, z0)
    _check_outputs(impl, y, S, z, q)
    return y.to(out_dtype), (S, z)
