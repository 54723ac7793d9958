"""The tied 50257-way head (`logits = h @ W.T`, W the (V, d) embedding), `ce_chunk` rows at
a time: at most one piece of logits exists, never several N x V tensors.
`chunked_cross_entropy` equals `F.cross_entropy(h @ W.T, targets)` in value and gradients;
`sample_tokens_chunked` has `torch.multinomial`'s distribution exactly, with one uniform
per row (statistically, not bitwise, equal).

Mixed precision: under autocast the matmul runs in the autocast dtype and the softmax
statistics in float32 (as `F.cross_entropy`); without, the inputs' dtype (half types keep
float32 statistics).
"""

from __future__ import annotations

import contextlib
import math
import numbers

import torch
import torch.nn.functional as F

_HALF_DTYPES = (torch.float16, torch.bfloat16)
_EXP_FLOOR = {dt: math.log(torch.finfo(dt).tiny) + 20.0 for dt in (torch.float32, torch.float64)}


# ----------------------------------------------------------------------------- validation

def _check_head_inputs(h: torch.Tensor, W: torch.Tensor, ce_chunk) -> None:
    if not isinstance(h, torch.Tensor) or h.dim() not in (2, 3) or not h.is_floating_point():
        got = (f"shape {tuple(h.shape)} dtype {h.dtype}" if isinstance(h, torch.Tensor)
               else type(h).__name__)
        raise ValueError(f"h must be a floating tensor of shape (N, d) or (B, C, d); got {got}")
    if not isinstance(W, torch.Tensor) or W.dim() != 2 or not W.is_floating_point():
        got = (f"shape {tuple(W.shape)} dtype {W.dtype}" if isinstance(W, torch.Tensor)
               else type(W).__name__)
        raise ValueError(f"W must be a floating tensor of shape (V, d); got {got}")
    if W.shape[1] != h.shape[-1]:
        raise ValueError(f"W must have shape (V, d={h.shape[-1]}) to match h; "
                         f"got W shape {tuple(W.shape)}")
    if W.shape[0] == 0 or h.numel() == 0:
        raise ValueError(f"need at least one row and one vocabulary entry; "
                         f"got h shape {tuple(h.shape)}, W shape {tuple(W.shape)}")
    if W.device != h.device:
        raise ValueError(f"h and W must be on the same device; got {h.device} and {W.device}")
    if h.dtype != W.dtype and not _autocast_enabled(h.device.type):
        raise ValueError(f"h and W must have the same dtype outside autocast; "
                         f"got {h.dtype} and {W.dtype}")
    if isinstance(ce_chunk, bool) or not isinstance(ce_chunk, numbers.Integral):
        raise ValueError(f"ce_chunk must be an int (<= 0 means one piece); got {ce_chunk!r}")


def _check_targets(targets: torch.Tensor, h: torch.Tensor, vocab: int) -> None:
    if not isinstance(targets, torch.Tensor):
        raise ValueError(f"targets must be an integer tensor; got {type(targets).__name__}")
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise ValueError(f"targets must be an integer tensor (int64 token ids); "
                         f"got dtype {targets.dtype}")
    if tuple(targets.shape) != tuple(h.shape[:-1]):
        raise ValueError(f"targets must have shape {tuple(h.shape[:-1])} (h without its last "
                         f"dim); got {tuple(targets.shape)}")
    if targets.device != h.device:
        raise ValueError(f"targets must be on {h.device} like h; got {targets.device}")
    # Reading the ids back is a device sync per step: CPU only (on CUDA gather's device-side
    # assert catches a bad id). Under torch.compile the read would break the graph and
    # specialise it on the values (a recompile per new min/max); the worker checks every
    # window on the host before the step instead.
    if targets.device.type == "cpu" and not torch.compiler.is_compiling():
        lo, hi = torch.aminmax(targets)
        if int(lo) < 0 or int(hi) >= vocab:
            raise ValueError(f"targets must be token ids in [0, {vocab}); "
                             f"got values in [{int(lo)}, {int(hi)}]")


# ----------------------------------------------------------------------------- helpers

def _autocast_enabled(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except (RuntimeError, TypeError):  # device types without autocast support
        return False


def _matmul_dtype(h: torch.Tensor) -> torch.dtype:
    """The dtype `h @ W.T` would compute in here: the autocast dtype if active, else h's
    (autocast leaves float64 alone)."""
    if _autocast_enabled(h.device.type) and h.dtype != torch.float64:
        return torch.get_autocast_dtype(h.device.type)
    return h.dtype


def _stats_dtype(matmul_dtype: torch.dtype) -> torch.dtype:
    """Softmax statistics never run in a half type (as F.cross_entropy under autocast)."""
    return torch.float32 if matmul_dtype in _HALF_DTYPES else matmul_dtype


def _no_autocast(device_type: str):
    """Casts below are explicit; keep autocast from re-casting (and from out= variants)."""
    if _autocast_enabled(device_type):
        return torch.autocast(device_type=device_type, enabled=False)
    return contextlib.nullcontext()


def _pieces(n_rows: int, ce_chunk: int) -> list[tuple[int, int]]:
    step = n_rows if ce_chunk <= 0 else min(int(ce_chunk), n_rows)
    return [(start, min(start + step, n_rows)) for start in range(0, n_rows, step)]


class _PieceLogits:
    """One piece of logits into buffers reused per piece (no allocation and page faults per
    piece); a second, float32 statistics buffer only when the matmul runs in a half type."""

    def __init__(self, hc: torch.Tensor, Wc: torch.Tensor, rows: int, stats_dtype):
        shape = (rows, Wc.shape[0])
        self.hc, self.Wc = hc, Wc
        self.logits = torch.empty(shape, dtype=Wc.dtype, device=Wc.device)
        self.stats = (self.logits if stats_dtype == Wc.dtype
                      else torch.empty(shape, dtype=stats_dtype, device=Wc.device))

    def __call__(self, start: int, stop: int) -> torch.Tensor:
        """Logits of rows [start, stop) in the statistics dtype (a view of the buffer)."""
        n = stop - start
        torch.mm(self.hc[start:stop], self.Wc.T, out=self.logits[:n])
        if self.stats is not self.logits:
            self.stats[:n].copy_(self.logits[:n])
        return self.stats[:n]


def _shift_exp_(x: torch.Tensor) -> torch.Tensor:
    """In place x <- exp(x - rowmax); returns the row max (n, 1), an infinite max replaced
    by 0 as torch.logsumexp does (+inf rows give +inf, all -inf rows -inf, NaN stays NaN)."""
    row_max = x.amax(dim=1, keepdim=True)
    row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    x.sub_(row_max)
    if x.dtype in _EXP_FLOOR:
        # exp of underflowing arguments (a fresh tied head spreads logits over hundreds) is
        # ~50x slower on CPU, and denormals slow the gradient matmuls as much. The floor keeps
        # every term, even / N, normal; it moves a probability by < 1e-29 (float32).
        x.clamp_(min=_EXP_FLOOR[x.dtype])
    x.exp_()
    return row_max


# ----------------------------------------------------------------------------- cross-entropy

class _ChunkedCrossEntropy(torch.autograd.Function):
    """Loss and gradients in one pass; each piece becomes, in place, exp(logits - max), then
    (softmax - onehot) / N. Versus recomputing logits in backward, this saves an N x V x d
    matmul and three passes per piece at no higher peak (the head is the forward's last op;
    the (V, d) gradient lives through backward either way)."""

    @staticmethod
    def forward(ctx, h, W, targets, ce_chunk, matmul_dtype, grad_enabled):
        n_rows = h.shape[0]
        want_h = grad_enabled and ctx.needs_input_grad[0]
        want_W = grad_enabled and ctx.needs_input_grad[1]
        stats_dtype = _stats_dtype(matmul_dtype)
        pieces = _pieces(n_rows, ce_chunk)
        with _no_autocast(h.device.type):
            hc, Wc = h.to(matmul_dtype), W.to(matmul_dtype)
            piece_logits = _PieceLogits(hc, Wc, pieces[0][1] - pieces[0][0], stats_dtype)
            loss_sum = torch.zeros((), dtype=stats_dtype, device=h.device)
            grad_h = torch.empty_like(hc) if want_h else None
            # dW accumulates over pieces in the statistics dtype (float32 under autocast).
            grad_W = torch.zeros(W.shape, dtype=stats_dtype, device=W.device) if want_W else None
            for start, stop in pieces:
                x = piece_logits(start, stop)
                target = targets[start:stop, None]
                target_logit = x.gather(1, target)
                row_max = _shift_exp_(x)  # x <- exp(logits - row max)
                row_sum = x.sum(dim=1, keepdim=True)
                loss_sum += (row_sum.log() + row_max - target_logit).sum()  # lse - target
                if not (want_h or want_W):
                    continue
                grad_logits = _mean_ce_grad_logits(x, target, row_sum, n_rows, piece_logits)
                if want_h:
                    torch.mm(grad_logits, Wc, out=grad_h[start:stop])
                if want_W:
                    if grad_W.dtype == grad_logits.dtype:
                        grad_W.addmm_(grad_logits.T, hc[start:stop])
                    else:
                        grad_W.add_(torch.mm(grad_logits.T, hc[start:stop]))
        ctx.save_for_backward(grad_h, grad_W)
        ctx.input_dtypes = (h.dtype, W.dtype)
        return loss_sum / n_rows

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        grad_h, grad_W = ctx.saved_tensors
        # Scaled in place: a second backward through a retained graph fails autograd's
        # saved-tensor version check (not gradients scaled twice), and no second (V, d)
        # tensor is allocated. grad_loss stays a tensor: reading it would sync the device.
        h_dtype, W_dtype = ctx.input_dtypes
        if grad_h is not None:
            grad_h = grad_h.to(h_dtype).mul_(grad_loss)
        if grad_W is not None:
            grad_W = grad_W.to(W_dtype).mul_(grad_loss)
        return grad_h, grad_W, None, None, None, None


def _mean_ce_grad_logits(x, target, row_sum, n_rows, piece_logits) -> torch.Tensor:
    """x = exp(logits - max) (n, V) -> dL/dlogits = (x / row_sum - onehot) / N, in place, in
    the matmul dtype (under autocast one pass scales and casts into the half logits buffer)."""
    x.scatter_add_(1, target, -row_sum)  # x - row_sum * onehot: (softmax - onehot) * row_sum
    scale = (row_sum * n_rows).reciprocal_()
    if x.dtype == piece_logits.logits.dtype:
        return x.mul_(scale)
    return torch.mul(x, scale, out=piece_logits.logits[:x.shape[0]])


def chunked_cross_entropy(h: torch.Tensor, W: torch.Tensor, targets: torch.Tensor,
                          ce_chunk: int) -> torch.Tensor:
    """Mean cross-entropy of `h @ W.T` against `targets`, `ce_chunk` rows at a time.
    h: (N, d) or (B, C, d); targets: ids shaped like h without its last dim, in [0, V) (no
    ignore_index); `ce_chunk <= 0` or `>= N`: one piece. Peak: one piece of logits (two
    under autocast). Gradients are kept, (N, d) + (V, d), from this call to backward: one
    backward per call, and one (V, d) gradient per forward pending. ValueError on bad
    inputs (ids only on CPU: `_check_targets`); NaN/Inf in h propagate.
    """
    _check_head_inputs(h, W, ce_chunk)
    _check_targets(targets, h, W.shape[0])
    h_rows = h.reshape(-1, h.shape[-1])
    target_rows = targets.reshape(-1).to(torch.int64)
    return _ChunkedCrossEntropy.apply(h_rows, W, target_rows, int(ce_chunk), _matmul_dtype(h),
                                      torch.is_grad_enabled())


def dense_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The reference form (CE_CHUNK=0 in the trainer): F.cross_entropy over flattened rows."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# ----------------------------------------------------------------------------- sampling

@torch.no_grad()
def sample_tokens_chunked(h: torch.Tensor, W: torch.Tensor, temperature: float,
                          ce_chunk: int, generator: torch.Generator | None = None
                          ) -> torch.Tensor:
    """One token per row from softmax(h @ W.T / temperature), `ce_chunk` rows at a time.
    h: (N, d) or (B, C, d) -> int64 (N,) or (B, C); same `generator` state, same tokens. A
    row of non-finite or zero total weight: FloatingPointError on CPU, a device-side assert
    elsewhere (no sync)."""
    _check_head_inputs(h, W, ce_chunk)
    if (isinstance(temperature, bool) or not isinstance(temperature, numbers.Real)
            or not math.isfinite(temperature) or temperature <= 0):
        raise ValueError(f"temperature must be a finite number > 0 (use argmax for greedy); "
                         f"got {temperature!r}")
    h_rows = h.reshape(-1, h.shape[-1])
    n_rows = h_rows.shape[0]
    matmul_dtype = _matmul_dtype(h)
    pieces = _pieces(n_rows, int(ce_chunk))
    tokens = torch.empty(n_rows, dtype=torch.int64, device=h.device)
    with _no_autocast(h.device.type):
        piece_logits = _PieceLogits(h_rows.to(matmul_dtype), W.to(matmul_dtype),
                                    pieces[0][1] - pieces[0][0], _stats_dtype(matmul_dtype))
        for start, stop in pieces:
            weights = piece_logits(start, stop).div_(temperature)
            _shift_exp_(weights)  # unnormalised softmax weights, max 1
            u = torch.rand((stop - start, 1), dtype=torch.float64, device=h.device,
                           generator=generator)
            tokens[start:stop] = _inverse_cdf(weights, u, start)
    return tokens.reshape(h.shape[:-1])


# Columns per block of the two-level cumulative sum; tests shrink it to cross block bounds.
_CDF_BLOCK = 1024


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor, first_row: int) -> torch.Tensor:
    """weights (n, V) >= 0, u (n, 1) float64 in [0, 1) -> (n,) int64: where u * total falls
    in the cumulative weights; never a zero-weight token. Two levels, no V-wide float64
    copy: block sums (weights' dtype, rel. error ~1e-7, float32's own) pick a block via a
    float64 cumsum; only that block is cumulated in float64, so each token keeps its exact
    share. (One float32 cumsum over 50257 entries shifts every boundary by up to ~6e-8 of
    the total: a large relative error for rare tokens.)"""
    n, vocab = weights.shape
    n_full = vocab // _CDF_BLOCK
    block_sums = [weights[:, :n_full * _CDF_BLOCK].reshape(n, n_full, _CDF_BLOCK).sum(dim=2)]
    if vocab % _CDF_BLOCK:
        block_sums.append(weights[:, n_full * _CDF_BLOCK:].sum(dim=1, keepdim=True))
    block_sums = torch.cat(block_sums, dim=1).to(torch.float64)
    block_cdf = block_sums.cumsum(dim=1)
    total = block_cdf[:, -1:]
    _check_totals(total, first_row)
    target = u * total
    # Rounding guards (they matter with probability ~1e-16): u * total may round up to the
    # total, a position may round past its block's end. Never step onto an entry of zero
    # weight because of them: clamp to the last positive block / entry.
    block = torch.searchsorted(block_cdf, target, right=True)
    block = torch.minimum(block, _last_positive(block_sums))
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp_(min=0)), 0.0)
    fraction = (target - before) / block_sums.gather(1, block)
    columns = block * _CDF_BLOCK + torch.arange(_CDF_BLOCK, device=weights.device)
    local = weights.gather(1, columns.clamp(max=vocab - 1)).to(torch.float64)
    local.masked_fill_(columns >= vocab, 0.0)
    local_cdf = local.cumsum(dim=1)
    offset = torch.searchsorted(local_cdf, fraction * local_cdf[:, -1:], right=True)
    offset = torch.minimum(offset, _last_positive(local))
    return columns.gather(1, offset).squeeze(1)


def _last_positive(values: torch.Tensor) -> torch.Tensor:
    """(n, k) -> (n, 1): index of the last positive entry of each row (0 if none)."""
    index = torch.arange(values.shape[1], device=values.device)
    return torch.where(values > 0, index, 0).amax(dim=1, keepdim=True)


def _check_totals(total: torch.Tensor, first_row: int) -> None:
    """A NaN/Inf (or all -inf) row has no distribution: fail loudly, never pick a token."""
    valid = torch.isfinite(total) & (total > 0)
    message = "sample_tokens_chunked: logits are NaN/Inf (or all -inf) in some rows"
    if total.device.type == "cpu":
        if not bool(valid.all()):
            bad = (~valid).squeeze(1).nonzero().squeeze(1)[:8] + first_row
            raise FloatingPointError(f"{message}: rows {bad.tolist()}")
    else:  # a device-side assert, as torch.multinomial does: no host sync
        torch._assert_async(valid.all(), message)
