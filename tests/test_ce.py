"""Chunked cross-entropy and chunked sampling against their dense definitions."""

import pytest
import torch
import torch.nn.functional as F

from fractus.nn import ce
from fractus.nn.ce import chunked_cross_entropy, dense_cross_entropy, sample_tokens_chunked

try:
    from scipy.stats import chi2 as _scipy_chi2
except ImportError:  # the chi-square critical value is then hard-coded (see below)
    _scipy_chi2 = None


def _head(n_rows, d, vocab, dtype, seed=0, shape=None):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(shape or (n_rows, d), generator=g, dtype=dtype)
    W = torch.randn(vocab, d, generator=g, dtype=dtype) * 0.7
    targets = torch.randint(0, vocab, h.shape[:-1], generator=g)
    return h.requires_grad_(), W.requires_grad_(), targets


def _loss_and_grads(loss_fn, h, W):
    loss = loss_fn()
    grad_h, grad_W = torch.autograd.grad(loss, (h, W))
    return loss.detach(), grad_h, grad_W


def _dense(h, W, targets):
    return lambda: F.cross_entropy((h @ W.T).reshape(-1, W.shape[0]), targets.reshape(-1))


def _chunked(h, W, targets, ce_chunk):
    return lambda: chunked_cross_entropy(h, W, targets, ce_chunk)


# N=37 rows: 8 does not divide it, 37 is one exact piece, 100 and <= 0 mean one piece.
CHUNKS = [8, 1, 37, 100, 0, -5]


@pytest.mark.parametrize("ce_chunk", CHUNKS)
def test_loss_and_gradients_equal_dense_float64(ce_chunk):
    h, W, t = _head(37, 16, 29, torch.float64)
    got = _loss_and_grads(_chunked(h, W, t, ce_chunk), h, W)
    want = _loss_and_grads(_dense(h, W, t), h, W)
    for g, w, name in zip(got, want, ("loss", "dL/dh", "dL/dW")):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("ce_chunk", CHUNKS)
def test_loss_and_gradients_equal_dense_float32(ce_chunk):
    h, W, t = _head(37, 16, 29, torch.float32, seed=1)
    got = _loss_and_grads(_chunked(h, W, t, ce_chunk), h, W)
    want = _loss_and_grads(_dense(h, W, t), h, W)
    for g, w, name in zip(got, want, ("loss", "dL/dh", "dL/dW")):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6 * float(w.abs().max()), msg=name)


def test_three_dimensional_input_matches_dense():
    h, W, t = _head(0, 12, 31, torch.float64, seed=2, shape=(3, 7, 12))
    got = _loss_and_grads(_chunked(h, W, t, 5), h, W)
    want = _loss_and_grads(_dense(h, W, t), h, W)
    assert got[1].shape == (3, 7, 12)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


def test_dense_cross_entropy_is_the_flattened_reference():
    h, W, t = _head(0, 6, 11, torch.float64, seed=3, shape=(2, 5, 6))
    logits = h @ W.T
    manual = -(torch.log_softmax(logits, -1).gather(-1, t[..., None])).mean()
    torch.testing.assert_close(dense_cross_entropy(logits, t), manual, rtol=1e-12, atol=0)


def test_incoming_gradient_scales_both_gradients():
    h, W, t = _head(20, 8, 13, torch.float64, seed=4)
    got = _loss_and_grads(lambda: 3.5 * chunked_cross_entropy(h, W, t, 6), h, W)
    want = _loss_and_grads(lambda: 3.5 * _dense(h, W, t)(), h, W)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


def test_tied_weight_gets_embedding_and_head_gradients():
    """W is both the embedding looked up for the inputs and the head: autograd adds both."""
    vocab, d, rows = 23, 10, 33
    g = torch.Generator().manual_seed(5)
    mix = torch.randn(d, d, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, vocab, (rows,), generator=g)
    targets = torch.randint(0, vocab, (rows,), generator=g)

    def grad_of_tied(loss_of_logits_or_chunked):
        W = (torch.randn(vocab, d, generator=torch.Generator().manual_seed(6),
                         dtype=torch.float64)).requires_grad_()
        h = torch.tanh(F.embedding(tokens, W) @ mix)
        loss_of_logits_or_chunked(h, W).backward()
        return W.grad

    got = grad_of_tied(lambda h, W: chunked_cross_entropy(h, W, targets, 7))
    want = grad_of_tied(lambda h, W: F.cross_entropy(h @ W.T, targets))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_only_h_needs_gradient():
    h, W, t = _head(19, 8, 17, torch.float64, seed=7)
    W = W.detach()
    loss = chunked_cross_entropy(h, W, t, 4)
    (grad_h,) = torch.autograd.grad(loss, (h,))
    (want,) = torch.autograd.grad(F.cross_entropy(h @ W.T, t), (h,))
    torch.testing.assert_close(grad_h, want, rtol=1e-10, atol=1e-12)


def test_no_grad_gives_the_same_loss():
    h, W, t = _head(30, 8, 21, torch.float64, seed=20)
    with torch.no_grad():
        loss = chunked_cross_entropy(h, W, t, 7)
        want = F.cross_entropy(h @ W.T, t)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=0)


def test_second_backward_through_a_retained_graph_fails_loudly():
    """Gradients are computed in forward and scaled in backward: a second backward must not
    silently return them scaled twice."""
    h, W, t = _head(9, 4, 6, torch.float32, seed=21)
    loss = chunked_cross_entropy(h, W, t, 4)
    loss.backward(retain_graph=True)
    first = h.grad.clone()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    torch.testing.assert_close(h.grad, first, rtol=0, atol=0)


def _largest_saved_numel(loss_fn):
    sizes = []

    def pack(tensor):
        sizes.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss_fn()
    return max(sizes)


def test_saved_for_backward_never_holds_rows_times_vocab():
    rows, d, vocab = 64, 8, 500
    h, W, t = _head(rows, d, vocab, torch.float32, seed=8)
    chunked = _largest_saved_numel(_chunked(h, W, t, 16))
    assert chunked <= max(rows * d, vocab * d) < rows * vocab
    # The same probe sees the dense form keep (at least) the full N x V logits.
    assert _largest_saved_numel(_dense(h, W, t)) >= rows * vocab


def test_autocast_bf16_matches_dense_autocast():
    """CPU bf16 autocast: bf16 matmuls, float32 statistics, like F.cross_entropy."""
    h, W, t = _head(40, 32, 300, torch.float32, seed=9)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _loss_and_grads(_chunked(h, W, t, 16), h, W)
        dense = _loss_and_grads(_dense(h, W, t), h, W)
    exact = _loss_and_grads(_dense(h.double(), W.double(), t), h, W)  # float64 truth
    assert got[0].dtype == dense[0].dtype == torch.float32
    assert got[1].dtype == h.dtype and got[2].dtype == W.dtype
    torch.testing.assert_close(got[0], dense[0], rtol=1e-3, atol=0)
    for g, d_, x in zip(got[1:], dense[1:], exact[1:]):
        ours = (g.double() - x).abs().max() / x.abs().max()
        theirs = (d_.double() - x).abs().max() / x.abs().max()
        assert ours <= 2 * theirs + 1e-3, (float(ours), float(theirs))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_autocast_matches_dense_autocast():
    h, W, t = _head(300, 64, 5000, torch.float32, seed=10)
    h, W, t = (h.detach().cuda().requires_grad_(), W.detach().cuda().requires_grad_(), t.cuda())
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = _loss_and_grads(_chunked(h, W, t, 128), h, W)
        dense = _loss_and_grads(_dense(h, W, t), h, W)
    exact = _loss_and_grads(_dense(h.double(), W.double(), t), h, W)
    torch.testing.assert_close(got[0], dense[0], rtol=1e-3, atol=0)
    for g, d_, x in zip(got[1:], dense[1:], exact[1:]):
        ours = (g.double() - x).abs().max() / x.abs().max()
        theirs = (d_.double() - x).abs().max() / x.abs().max()
        assert ours <= 2 * theirs + 1e-3, (float(ours), float(theirs))


def test_nan_and_inf_in_h_propagate():
    h, W, t = _head(12, 6, 9, torch.float32, seed=11)
    bad = h.detach().clone()
    bad[3, 2] = float("nan")
    bad.requires_grad_()
    loss = chunked_cross_entropy(bad, W, t, 5)
    assert torch.isnan(loss)
    (grad_h,) = torch.autograd.grad(loss, (bad,))
    assert torch.isnan(grad_h).any()
    inf = h.detach().clone()
    inf[7, 0] = float("inf")
    assert not torch.isfinite(chunked_cross_entropy(inf, W, t, 5))


@pytest.mark.parametrize("case, words", [
    ("float targets", ["integer", "float32"]),
    ("negative id", ["[0, 9)", "-1"]),
    ("id == V", ["[0, 9)", "9"]),
    ("targets shape", ["(12,)", "(12, 1)"]),
    ("h rank 1", ["(N, d)", "(6,)"]),
    ("h rank 4", ["(B, C, d)", "(1, 2, 6, 6)"]),
    ("W width", ["d=6", "(9, 5)"]),
    ("h integer", ["floating", "int64"]),
    ("dtype mismatch", ["same dtype", "float64"]),
    ("ce_chunk float", ["ce_chunk", "2.5"]),
])
def test_bad_inputs_raise_value_error_naming_expected_and_got(case, words):
    h, W, t = _head(12, 6, 9, torch.float32, seed=12)
    args = {"h": h, "W": W, "targets": t, "ce_chunk": 4}
    if case == "float targets":
        args["targets"] = t.float()
    elif case == "negative id":
        args["targets"] = t.clone().index_fill_(0, torch.tensor([2]), -1)
    elif case == "id == V":
        args["targets"] = t.clone().index_fill_(0, torch.tensor([5]), 9)
    elif case == "targets shape":
        args["targets"] = t[:, None]
    elif case == "h rank 1":
        args["h"] = h[0]
    elif case == "h rank 4":
        args["h"] = h.reshape(1, 2, 6, 6)
    elif case == "W width":
        args["W"] = W[:, :5]
    elif case == "h integer":
        args["h"] = h.detach().long()
    elif case == "dtype mismatch":
        args["W"] = W.double()
    elif case == "ce_chunk float":
        args["ce_chunk"] = 2.5
    with pytest.raises(ValueError) as info:
        chunked_cross_entropy(**args)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


# ----------------------------------------------------------------------------- sampling

CHI2_CRITICAL_P001 = {5: 20.515, 6: 22.458, 7: 24.322}  # chi-square quantiles at 1 - 0.001


def _chi2_critical(dof):
    if _scipy_chi2 is not None:
        return float(_scipy_chi2.ppf(1 - 0.001, dof))
    return CHI2_CRITICAL_P001[dof]


def _chi_square(counts, probs):
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("cdf_block", [ce._CDF_BLOCK, 3])
def test_sampler_frequencies_follow_softmax(monkeypatch, cdf_block):
    """Two interleaved row types, each with its own distribution; V=8, one token of exactly
    zero weight. Small cdf blocks (3 columns) exercise the block boundaries."""
    monkeypatch.setattr(ce, "_CDF_BLOCK", cdf_block)
    _check_sampler_frequencies("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_sampler_frequencies_follow_softmax():
    """The worker's SS sampler on the GPU (its own generator there) draws the same law."""
    _check_sampler_frequencies("cuda")


def _check_sampler_frequencies(device: str) -> None:
    vocab, d, temperature = 8, 4, 0.9
    g = torch.Generator().manual_seed(13)
    W = torch.randn(vocab, d, generator=g, dtype=torch.float64)
    W[5] = torch.tensor([-1e4, 0.0, 0.0, 0.0], dtype=torch.float64)  # weight exp(-1e4/T) = 0
    kinds = torch.tensor([[1.0, 0.3, -0.5, 0.8], [1.0, -1.2, 0.9, 0.1]], dtype=torch.float64)
    draws_per_kind = 3000
    h = kinds.repeat(draws_per_kind, 1)  # rows alternate kind 0, kind 1
    tokens = sample_tokens_chunked(h.to(device), W.to(device), temperature, ce_chunk=256,
                                   generator=torch.Generator(device).manual_seed(14)).cpu()
    probs = torch.softmax(kinds @ W.T / temperature, dim=-1)
    for kind in range(2):
        counts = torch.bincount(tokens[kind::2], minlength=vocab).double()
        assert counts[5] == 0
        keep = probs[kind] > 0
        stat = _chi_square(counts[keep], probs[kind][keep])
        assert stat < _chi2_critical(int(keep.sum()) - 1), (kind, stat, counts.tolist())


def test_two_level_inverse_cdf_matches_a_float64_cumulative_sum():
    """Several 1024-column blocks and a partial one, exact zeros and tiny weights: the
    token is where u * total falls in the float64 cumulative weights, except (rarely) at
    a boundary that float32 block sums move by ~1e-7 of the total: then a neighbour."""
    g = torch.Generator().manual_seed(22)
    weights = torch.rand(2000, 2500, generator=g)
    weights[weights < 0.2] = 0.0
    weights[:, 1500:1600] = 1e-30
    u = torch.rand(2000, 1, generator=g, dtype=torch.float64)
    got = ce._inverse_cdf(weights, u, first_row=0)
    cdf = weights.double().cumsum(dim=1)
    want = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1)
    picked = weights.double().gather(1, got[:, None]).squeeze(1)
    assert (picked > 0).all()
    assert int((got != want).sum()) <= 10
    position = u.squeeze(1) * cdf[:, -1]
    upper = cdf.gather(1, got[:, None]).squeeze(1)
    slack = 1e-6 * cdf[:, -1]
    assert ((upper - picked - slack <= position) & (position < upper + slack)).all()


def test_sampler_is_deterministic_for_a_seed_and_varies_across_seeds():
    h, W, _ = _head(300, 8, 40, torch.float32, seed=15)
    h, W = h.detach() * 0.3, W.detach()

    def draw(seed):
        return sample_tokens_chunked(h, W, 1.0, 64, generator=torch.Generator().manual_seed(seed))

    assert torch.equal(draw(1), draw(1))
    assert not torch.equal(draw(1), draw(2))


def test_sampler_tiny_temperature_is_argmax_and_keeps_shape():
    h, W, _ = _head(0, 8, 50, torch.float32, seed=16, shape=(3, 11, 8))
    h, W = h.detach(), W.detach()
    logits = h @ W.T
    top2 = logits.topk(2, dim=-1).values
    assert float((top2[..., 0] - top2[..., 1]).min()) > 1e-3  # no near-ties in this draw
    tokens = sample_tokens_chunked(h, W, 1e-5, 7, generator=torch.Generator().manual_seed(0))
    assert tokens.shape == (3, 11) and tokens.dtype == torch.int64
    assert torch.equal(tokens, logits.argmax(dim=-1))


def test_sampler_rows_keep_their_order_across_pieces():
    """Each row has its own near-deterministic token: a piece mix-up would show."""
    vocab = 12
    W = torch.eye(vocab) * 50.0
    wanted = torch.tensor([3, 7, 0, 11, 5, 5, 2, 9, 1, 10, 4])
    h = W[wanted] / 50.0  # row i's logits peak (by 50) at wanted[i]
    tokens = sample_tokens_chunked(h, W, 1.0, 4, generator=torch.Generator().manual_seed(0))
    assert torch.equal(tokens, wanted)


@pytest.mark.parametrize("temperature", [0, -1.0, float("nan"), float("inf"), True, "0.9"])
def test_sampler_rejects_bad_temperature(temperature):
    h, W, _ = _head(4, 3, 5, torch.float32, seed=17)
    with pytest.raises(ValueError, match="temperature"):
        sample_tokens_chunked(h.detach(), W.detach(), temperature, 2)


def test_sampler_refuses_nan_rows_instead_of_inventing_tokens():
    h, W, _ = _head(10, 3, 5, torch.float32, seed=18)
    h = h.detach().clone()
    h[6, 1] = float("nan")
    with pytest.raises(FloatingPointError, match=r"rows \[6\]"):
        sample_tokens_chunked(h, W.detach(), 1.0, 4)


def test_sampler_needs_no_gradient():
    h, W, _ = _head(6, 3, 5, torch.float32, seed=19)
    tokens = sample_tokens_chunked(h, W, 0.9, 4)
    assert not tokens.requires_grad and tokens.grad_fn is None
