"""Every linear-attention kernel computes the reference function, values and gradients.

The ground truth here is a per-token python loop written independently of the kernels.
"""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from fractus.nn import attention as attn
from fractus.nn.attention import linear_attention

BUILTINS = ("einsum", "cumsum", "chunked")
LENGTHS = (1, 63, 64, 65, 128, 200)
TOL = {torch.float64: 1e-10, torch.float32: 1e-4}
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(autouse=True)
def _restore_global_choice():
    yield
    for name in set(attn.ATTENTION_IMPLS) - set(BUILTINS):
        attn.unregister_attention_impl(name)
    attn.set_attention_impl(None)


def loop_reference(q, k, v, S0=None, z0=None):
    """One position at a time: add k_t v_t^T to the state, then read it with q_t."""
    G, C, D = q.shape
    S = torch.zeros(G, D, D, dtype=q.dtype, device=q.device) if S0 is None else S0
    z = torch.zeros(G, D, dtype=q.dtype, device=q.device) if z0 is None else z0
    ys = []
    for t in range(C):
        S = S + k[:, t, :, None] * v[:, t, None, :]
        z = z + k[:, t]
        num = (q[:, t, :, None] * S).sum(dim=1)
        den = (q[:, t] * z).sum(dim=1, keepdim=True)
        ys.append(torch.where(den.abs() > 1e-10, num / (den + 1e-20), torch.zeros_like(num)))
    return torch.stack(ys, dim=1), S, z


def make_inputs(G, C, D, dtype, carry, seed, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)
    q, k = F.elu(rand(G, C, D)) + 1, F.elu(rand(G, C, D)) + 1  # positive features
    tensors = [q, k, rand(G, C, D)]
    if carry:
        tensors += [0.5 * rand(G, D, D), rand(G, D).abs()]  # z0 > 0 keeps den away from 0
    return [t.to(device=device, dtype=dtype).requires_grad_() for t in tensors]


def rel_err(actual, expected):
    """Max error relative to the largest entry; floor 1 (inputs are O(1)), since some exact
    results are 0 (e.g. dq at C=1 without carry, where y = v whatever q is)."""
    scale = expected.detach().abs().max().clamp_min(1.0)
    return ((actual.detach() - expected.detach()).abs().max() / scale).item()


def run(impl, q, k, v, *carry):
    y, (S, z) = linear_attention(q, k, v, tuple(carry) if carry else None, impl=impl)
    return y, S, z


def outputs_and_grads(fn, inputs, seed):
    """Outputs and the gradients of a random linear function of (y, S, z)."""
    y, S, z = fn(*inputs)
    gen = torch.Generator().manual_seed(seed + 1)
    ups = [torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t) for t in (y, S, z)]
    loss = sum((t * u).sum() for t, u in zip((y, S, z), ups))
    return [y, S, z], list(torch.autograd.grad(loss, inputs))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("carry", [False, True], ids=["nocarry", "carry"])
@pytest.mark.parametrize("C", LENGTHS)
@pytest.mark.parametrize("impl", BUILTINS)
def test_kernel_matches_per_token_loop(impl, C, carry, dtype, device):
    seed = 1000 * C + carry
    inputs = make_inputs(3, C, 8, dtype, carry, seed, device)
    got, got_grads = outputs_and_grads(lambda *t: run(impl, *t), inputs, seed)
    want, want_grads = outputs_and_grads(loop_reference, inputs, seed)
    names = ["y", "S", "z", "dq", "dk", "dv", "dS0", "dz0"]
    for name, a, b in zip(names, got + got_grads, want + want_grads):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert rel_err(a, b) <= TOL[dtype], f"{impl} {name}: rel err {rel_err(a, b):.2e}"


@pytest.mark.parametrize("impl", ["einsum", "chunked"])
def test_kernels_agree_with_each_other_at_head_width(impl):
    # d_head 64 as in the 1B model, two full blocks of the chunked kernel.
    inputs = make_inputs(4, 128, 64, torch.float64, True, seed=7)
    got, got_grads = outputs_and_grads(lambda *t: run(impl, *t), inputs, seed=7)
    want, want_grads = outputs_and_grads(lambda *t: run("cumsum", *t), inputs, seed=7)
    for a, b in zip(got + got_grads, want + want_grads):
        assert rel_err(a, b) <= 1e-10


@pytest.mark.parametrize("block", [1, 5, 64, 500])
def test_chunked_exact_for_any_block_size(block):
    inputs = make_inputs(2, 130, 8, torch.float64, True, seed=block)
    got, got_grads = outputs_and_grads(
        lambda *t: attn.chunked_attention(*t, block=block), inputs, seed=block)
    want, want_grads = outputs_and_grads(loop_reference, inputs, seed=block)
    for a, b in zip(got + got_grads, want + want_grads):
        assert rel_err(a, b) <= 1e-10


@pytest.mark.parametrize("impl", BUILTINS)
def test_small_denominator_gives_exact_zero(impl):
    D, C = 4, 3
    k = torch.ones(1, C, D, dtype=torch.float64)
    v = torch.randn(1, C, D, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    # den_t = c_t * D * (t + 1): 0 at t=0, 0.8e-10 (zeroed) at t=1, 3e-10 (kept) at t=2.
    c = torch.tensor([0.0, 0.8e-10 / (2 * D), 3e-10 / (3 * D)], dtype=torch.float64)
    q = (c[None, :, None] * torch.ones(1, C, D, dtype=torch.float64)).requires_grad_()
    y, _ = linear_attention(q, k, v, impl=impl)
    assert torch.equal(y[0, :2], torch.zeros(2, D, dtype=torch.float64))
    den = 3e-10
    expected = (c[2] * D * v[0].sum(0)) / (den + 1e-20)
    assert rel_err(y[0, 2], expected) <= 1e-10
    # The boundary itself: den == 1e-10 exactly (one term, 1e-10 * 1.0) is zeroed too.
    one = torch.ones(1, 1, 1, dtype=torch.float64)
    y, _ = linear_attention(1e-10 * one, one, one, impl=impl)
    assert y.item() == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("impl", BUILTINS)
def test_zeroed_rows_have_finite_gradients(impl, dtype):
    # den = q . z0 = 1 - 1 = 0 while num = q @ S0 != 0: y = 0, and the discarded division
    # must not put inf or NaN into any gradient (1/(1e-20)^2 overflows in float32).
    q = torch.tensor([[[1.0, 1.0]]], dtype=dtype, requires_grad=True)
    k = torch.zeros(1, 1, 2, dtype=dtype, requires_grad=True)
    v = torch.ones(1, 1, 2, dtype=dtype, requires_grad=True)
    S0 = torch.ones(1, 2, 2, dtype=dtype, requires_grad=True)
    z0 = torch.tensor([[1.0, -1.0]], dtype=dtype, requires_grad=True)
    y, _ = linear_attention(q, k, v, (S0, z0), impl=impl)
    assert torch.equal(y, torch.zeros_like(y))
    grads = torch.autograd.grad(y.sum(), (q, k, v, S0, z0))
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("impl", BUILTINS)
def test_nan_and_inf_inputs_propagate(impl):
    q, k, v, S0, z0 = [t.detach() for t in make_inputs(2, 70, 8, torch.float32, True, seed=5)]
    v_nan = v.clone()
    v_nan[0, 66, 3] = float("nan")  # in the second block of the chunked kernel
    y, (S, _) = linear_attention(q, k, v_nan, (S0, z0), impl=impl)
    assert torch.isnan(y[0, 66:, 3]).all() and torch.isnan(S[0, :, 3]).all()
    assert torch.isfinite(y[1]).all(), "groups are independent"
    # Earlier positions: a masked matmul computes 0 * NaN = NaN, so the NaN also reaches the
    # earlier rows of its block (chunked) or chunk (einsum, as in the reference); never beyond.
    clean_before = {"einsum": 0, "cumsum": 66, "chunked": attn.CHUNK_BLOCK}[impl]
    assert torch.isfinite(y[0, :clean_before]).all()
    q_nan = q.clone()
    q_nan[1, 10, 0] = float("nan")  # NaN denominator: propagated, not zeroed
    y, _ = linear_attention(q_nan, k, v, (S0, z0), impl=impl)
    assert torch.isnan(y[1, 10]).all()
    k_inf = k.clone()
    k_inf[0, 0, 0] = float("inf")
    y, (_, z) = linear_attention(q, k_inf, v, (S0, z0), impl=impl)
    assert not torch.isfinite(y[0, 5]).any() and torch.isinf(z[0, 0])


@pytest.mark.parametrize("impl", BUILTINS)
def test_half_precision_inputs_accumulate_in_float32(impl):
    # 1000 positive terms: a bf16 running sum stalls (spacing 2 above 256, 4 above 512, ...),
    # a float32 one stays within float32 rounding of the exact sum of the rounded inputs.
    q, k, v = [t.detach().to(torch.bfloat16) for t in make_inputs(2, 1000, 4, torch.float64,
                                                                  False, seed=9)[:3]]
    y, (S, z) = linear_attention(q, k, v, impl=impl)
    assert y.dtype == torch.bfloat16 and S.dtype == torch.float32 and z.dtype == torch.float32
    y_ref, S_ref, z_ref = loop_reference(q.double(), k.double(), v.double())
    assert rel_err(S.double(), S_ref) <= 1e-5 and rel_err(z.double(), z_ref) <= 1e-5
    assert rel_err(y.double(), y_ref) <= 1e-2  # y itself is rounded to bf16 on the way out


@pytest.mark.parametrize("impl", BUILTINS)
def test_cpu_autocast_does_not_lower_kernel_precision(impl):
    q, k, v, S0, z0 = [t.detach() for t in make_inputs(2, 100, 16, torch.float64, True, seed=9)]
    y_ref, S_ref, _ = loop_reference(q, k, v, S0, z0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, (S, _) = linear_attention(q.float(), k.float(), v.float(),
                                     (S0.float(), z0.float()), impl=impl)
    assert y.dtype == torch.float32 and S.dtype == torch.float32
    assert rel_err(y.double(), y_ref) <= 1e-4 and rel_err(S.double(), S_ref) <= 1e-4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("impl", BUILTINS)
def test_cuda_bf16_autocast_matches_reference(impl):
    q, k, v, S0, z0 = [t.detach() for t in make_inputs(4, 128, 64, torch.float64, True, seed=11)]
    y_ref, S_ref, _ = loop_reference(q, k, v, S0, z0)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        dev = [t.cuda().to(torch.bfloat16) for t in (q, k, v)]
        y, (S, _) = linear_attention(*dev, (S0.cuda().float(), z0.cuda().float()), impl=impl)
    assert rel_err(y.double().cpu(), y_ref) <= 3e-2 and rel_err(S.double().cpu(), S_ref) <= 3e-2


@pytest.mark.parametrize("impl", ["chunked", "cumsum"])
def test_torch_compile_full_graph(impl):
    inputs = make_inputs(2, 65, 8, torch.float32, True, seed=13)
    compiled = torch.compile(lambda q, k, v, S0, z0: run(impl, q, k, v, S0, z0),
                             backend="aot_eager", fullgraph=True)
    got, got_grads = outputs_and_grads(compiled, inputs, seed=13)
    want, want_grads = outputs_and_grads(lambda *t: run(impl, *t), inputs, seed=13)
    for a, b in zip(got + got_grads, want + want_grads):
        assert rel_err(a, b) <= 1e-5


# ---- run-time choice -------------------------------------------------------------------------

def test_set_get_and_unknown_names(monkeypatch):
    monkeypatch.delenv(attn.ENV_VAR, raising=False)
    attn.set_attention_impl(None)
    assert attn.get_attention_impl("cpu") == "cumsum"
    assert attn.get_attention_impl("cuda") == "chunked"
    assert set(BUILTINS) <= set(attn.ATTENTION_IMPLS)
    attn.set_attention_impl("einsum")
    assert attn.get_attention_impl("cpu") == "einsum" == attn.get_attention_impl("cuda")
    for bad in (lambda: attn.set_attention_impl("flash"),
                lambda: linear_attention(*make_inputs(1, 4, 2, torch.float32, False, 0),
                                         impl="flash")):
        with pytest.raises(ValueError) as err:
            bad()
        assert "'flash'" in str(err.value) and all(n in str(err.value) for n in BUILTINS)
    assert attn.get_attention_impl("cpu") == "einsum", "a rejected name changes nothing"


def test_env_var_is_read_lazily_and_explicit_choice_wins(monkeypatch):
    monkeypatch.setenv(attn.ENV_VAR, "chunked")
    attn.set_attention_impl(None)  # forget any earlier read
    assert attn.get_attention_impl("cpu") == "chunked"
    monkeypatch.setenv(attn.ENV_VAR, "einsum")
    assert attn.get_attention_impl("cpu") == "chunked", "read once, at first use"
    attn.set_attention_impl("cumsum")
    assert attn.get_attention_impl("cpu") == "cumsum"
    monkeypatch.setenv(attn.ENV_VAR, "bogus")
    attn.set_attention_impl(None)
    with pytest.raises(ValueError, match=f"{attn.ENV_VAR}.*einsum, cumsum, chunked"):
        linear_attention(*make_inputs(1, 4, 2, torch.float32, False, 0))


def test_use_attention_impl_restores_the_previous_choice(monkeypatch):
    monkeypatch.delenv(attn.ENV_VAR, raising=False)
    attn.set_attention_impl(None)
    with attn.use_attention_impl("einsum"):
        assert attn.get_attention_impl("cpu") == "einsum"
    monkeypatch.setenv(attn.ENV_VAR, "chunked")  # not read yet: the block never needed it
    assert attn.get_attention_impl("cpu") == "chunked", "automatic again, so the env var counts"
    attn.set_attention_impl("cumsum")
    with pytest.raises(ValueError):
        with attn.use_attention_impl("nope"):
            pass
    with attn.use_attention_impl("einsum"):
        pass
    assert attn.get_attention_impl("cpu") == "cumsum"


def test_env_var_in_a_fresh_process():
    code = ("import torch; from fractus.nn.attention import get_attention_impl, linear_attention;"
            "x = torch.rand(1, 3, 2); linear_attention(x, x, x); print(get_attention_impl('cpu'))")
    env = dict(os.environ, **{attn.ENV_VAR: "einsum"})
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "einsum", out.stderr


def test_register_attention_impl():
    def doubled(q, k, v, S0, z0):
        y, S, z = attn.cumsum_attention(q, k, v, S0, z0)
        return 2 * y, S, z

    inputs = [t.detach() for t in make_inputs(2, 9, 4, torch.float64, True, seed=17)]
    attn.register_attention_impl("doubled", doubled)
    assert "doubled" in attn.ATTENTION_IMPLS
    y2, _ = linear_attention(*inputs[:3], tuple(inputs[3:]), impl="doubled")
    attn.set_attention_impl("doubled")
    y2_global, _ = linear_attention(*inputs[:3], tuple(inputs[3:]))
    y1, _ = linear_attention(*inputs[:3], tuple(inputs[3:]), impl="cumsum")
    assert torch.equal(y2, 2 * y1) and torch.equal(y2_global, y2)
    with pytest.raises(ValueError, match="built in"):
        attn.register_attention_impl("chunked", doubled)
    attn.register_attention_impl("bad_shape", lambda q, k, v, S0, z0: (q[:, :1], S0, z0))
    with pytest.raises(ValueError, match=r"'bad_shape' returned y of shape \(2, 1, 4\)"):
        linear_attention(*inputs[:3], impl="bad_shape")
    attn.unregister_attention_impl("doubled")
    assert "doubled" not in attn.ATTENTION_IMPLS
    assert attn.get_attention_impl("cpu") == "cumsum", "choice of a removed kernel is dropped"


# ---- bad input -------------------------------------------------------------------------------

def _bad_cases():
    good = lambda *s: torch.rand(*s)
    q = good(2, 5, 4)
    yield "rank", (good(5, 4), good(5, 4), good(5, 4), None), "(G, C, D)", "(5, 4)"
    yield "k length", (q, good(2, 6, 4), q, None), "k of shape (2, 5, 4)", "(2, 6, 4)"
    yield "v width", (q, q, good(2, 5, 3), None), "v of shape (2, 5, 4)", "(2, 5, 3)"
    yield "empty", (good(2, 0, 4),) * 3 + (None,), "C >= 1", "(2, 0, 4)"
    yield "S0", (q, q, q, (good(2, 4, 5), good(2, 4))), "S0 of shape (2, 4, 4)", "(2, 4, 5)"
    yield "z0", (q, q, q, (good(2, 4, 4), good(3, 4))), "z0 of shape (2, 4)", "(3, 4)"
    yield "carry", (q, q, q, (good(2, 4, 4),)), "pair (S0, z0)", "tuple"
    yield "dtype", (q, q, torch.ones(2, 5, 4, dtype=torch.long), None), "floating", "int64"


@pytest.mark.parametrize("case", list(_bad_cases()), ids=lambda c: c[0])
def test_bad_input_raises_before_computing(case):
    _, (q, k, v, carry), expected, got = case
    calls = []
    attn.register_attention_impl("spy", lambda *a: calls.append(1) or attn.cumsum_attention(*a))
    with pytest.raises(ValueError) as err:
        linear_attention(q, k, v, carry, impl="spy")
    assert expected in str(err.value) and got in str(err.value)
    assert calls == [], "the kernel must not run on bad input"
