"""Engine behaviour beyond the fixtures: fast paths equal to slow ones, loading, bad input."""

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from fractus.config import PRESETS, EngineConfig, load_model_config
from fractus.continuous_engine import ContinuousThoughtEngine, check_token_ids
from fractus.nn.farey import expert_phases, farey_sequence
from fractus.nn.moe import PhaseRoutedMoE

TINY = PRESETS["tiny"]


def make_engine(seed=0, **overrides) -> ContinuousThoughtEngine:
    torch.manual_seed(seed)
    cfg = EngineConfig(**{**TINY.to_dict(), **overrides})
    model = ContinuousThoughtEngine.from_config(cfg)
    with torch.no_grad():  # move LayerNorms off identity: production checkpoints are trained
        for name, p in model.named_parameters():
            if "norm_" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def tokens(B, C, vocab=TINY.vocab_size, seed=1):
    return torch.randint(0, vocab, (B, C), generator=torch.Generator().manual_seed(seed))


def clone_engine(model) -> ContinuousThoughtEngine:
    twin = ContinuousThoughtEngine.from_config(model.config)
    twin.load_state_dict(model.state_dict())
    return twin


# --------------------------------------------------------------------------- building blocks

def test_farey_sequence_small_orders():
    assert farey_sequence(1) == [(0, 1), (1, 1)]
    assert farey_sequence(4) == [(0, 1), (1, 4), (1, 3), (1, 2), (2, 3), (3, 4), (1, 1)]


def test_expert_phases_match_the_fixture_buffers(legacy_fixture_dir):
    for variant in ("lowrank_sparse", "lowrank_dense", "three_levels"):
        state = torch.load(legacy_fixture_dir / f"{variant}.pt", weights_only=True)["checkpoint"]["model_state"]
        stored = state["blocks.0.moe.expert_phases"]
        assert torch.equal(torch.tensor(expert_phases(len(stored)), dtype=torch.float32), stored)


@pytest.mark.parametrize("n_experts,top_k,rank", [(8, 2, 16), (4, 2, 8), (6, 1, 0), (3, 2, 0)])
def test_moe_row_dispatch_equals_reference_token_dispatch(n_experts, top_k, rank):
    torch.manual_seed(0)
    moe = PhaseRoutedMoE(32, n_experts, top_k, d_ff=24, expert_rank=rank or None).double()
    moe.temperature = 2.5
    h = torch.randn(3, 11, 32, dtype=torch.float64, requires_grad=True)
    phases = (torch.rand(3, 1, 5, dtype=torch.float64) * 2 * math.pi).requires_grad_()

    results = []
    for dispatch in ("auto", "token"):
        moe.dispatch = dispatch
        moe.zero_grad()
        h.grad = phases.grad = None
        out, lb = moe(h, phases)
        (out.square().sum() + lb).backward()
        results.append((out.detach(), lb.detach(), h.grad.clone(), phases.grad.clone(),
                        {n: p.grad.clone() for n, p in moe.named_parameters()}))
    (o1, l1, gh1, gp1, gw1), (o2, l2, gh2, gp2, gw2) = results
    torch.testing.assert_close(o1, o2, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(l1, l2, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gh1, gh2, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gp1, gp2, rtol=1e-10, atol=1e-12)
    for name in gw1:
        torch.testing.assert_close(gw1[name], gw2[name], rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------------- engine paths

def test_tick_chunk_train_ce_equals_dense_ce_and_its_gradients():
    model = make_engine()
    twin = clone_engine(model)
    obs, targets = tokens(2, 20), tokens(2, 20, seed=2)
    for m in (model, twin):
        m.reset_thought(2)
        m.set_gate_temperature(2.5)

    logits, lb = model.tick_chunk_train(obs)
    dense = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    (dense + 0.02 * lb).backward()

    ce, lb2, h = twin.tick_chunk_train_ce(obs, targets, ce_chunk=7, return_hidden=True)
    (ce + 0.02 * lb2).backward()

    assert h.shape == (2, 20, TINY.d_model)
    torch.testing.assert_close(ce, dense, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lb2, lb)
    for (name, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
        if p.grad is None:
            assert q.grad is None, name
            continue
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)
    for a, b in zip(model.carry_state().values(), twin.carry_state().values()):
        torch.testing.assert_close(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_train_step_matches_cpu_in_fp32_and_within_the_bf16_band():
    """The worker's step on CUDA: float32 (TF32 off) equals the CPU's to float rounding;
    under bf16 autocast the loss stays within bf16's band of float32 measured on the CPU
    (1e-3 relative, tests/test_bf16_band.py)."""
    obs, targets = tokens(2, 20), tokens(2, 20, seed=2)

    def step(model, device, autocast):
        model = model.to(device)
        model.reset_thought(2)
        model.set_gate_temperature(2.5)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            ce, lb = model.tick_chunk_train_ce(obs.to(device), targets.to(device), ce_chunk=7)
        (ce + 0.02 * lb).backward()
        return ce.float().cpu(), {n: p.grad.float().cpu() for n, p in model.named_parameters()
                                  if p.grad is not None}

    cpu_model = make_engine()
    ref_ce, ref_grads = step(cpu_model, "cpu", False)
    torch.backends.cuda.matmul.allow_tf32 = False
    ce32, grads32 = step(clone_engine(cpu_model), "cuda", False)
    torch.testing.assert_close(ce32, ref_ce, rtol=1e-4, atol=1e-5)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads32[name], grad, rtol=1e-3, atol=1e-5, msg=name)
    ce16, _ = step(clone_engine(cpu_model), "cuda", True)
    assert abs(float(ce16) - float(ref_ce)) <= 1e-3 * abs(float(ref_ce))


def test_carry_state_roundtrip_gives_identical_next_chunk():
    model = make_engine()
    model.reset_thought(2)
    model.tick_chunk(tokens(2, 9))
    saved = model.carry_state()
    expected = model.tick_chunk(tokens(2, 9, seed=5))

    other = clone_engine(model)
    other.load_carry_state(saved)
    assert torch.equal(other.tick_chunk(tokens(2, 9, seed=5)), expected)
    with pytest.raises(ValueError, match="missing"):
        other.load_carry_state({"thought_state": saved["thought_state"]})


def test_no_buffer_holds_an_autograd_graph():
    model = make_engine()
    model.reset_thought(2)
    logits, lb = model.tick_chunk_train(tokens(2, 8))
    model.tick_chunk_train_ce(tokens(2, 8), tokens(2, 8, seed=3), ce_chunk=5)
    for name, buf in model.named_buffers():
        assert buf.grad_fn is None and not buf.requires_grad, name


def test_batch_one_state_broadcasts_and_other_mismatch_is_refused():
    model = make_engine()  # fresh buffers have batch 1, as in the reference
    logits = model.tick_chunk(tokens(3, 4))
    assert logits.shape == (3, 4, TINY.vocab_size)
    assert model.carried_batch_size == 3
    with pytest.raises(ValueError, match="reset_thought"):
        model.tick_chunk(tokens(2, 4))


# --------------------------------------------------------------------------- checkpoints

def legacy_dict(model, batch):
    model.reset_thought(batch)
    model.tick_chunk(tokens(batch, 6))
    return {"model_state": model.state_dict(), "config": {**model.config.to_dict(), "gpu": 3, "lr": 7e-4}}


def test_from_checkpoint_strips_compiled_prefix_and_restores_carry(tmp_path):
    model = make_engine()
    ckpt = legacy_dict(model, batch=2)
    ckpt["model_state"] = {f"_orig_mod.{k}": v for k, v in ckpt["model_state"].items()}
    path = tmp_path / "fractus_1b_gpu3.pt"
    torch.save(ckpt, path)

    loaded = ContinuousThoughtEngine.from_checkpoint(path)
    assert loaded.carried_batch_size == 2
    assert torch.equal(loaded.tick_chunk(tokens(2, 6, seed=9)), model.tick_chunk(tokens(2, 6, seed=9)))
    assert loaded.output_head.weight is loaded.observe.weight


def test_from_checkpoint_with_another_batch_resets_carry_with_a_warning(legacy_fixture_dir):
    fx = torch.load(legacy_fixture_dir / "lowrank_sparse.pt", weights_only=True)
    with pytest.warns(UserWarning, match="reset"):
        model = ContinuousThoughtEngine.from_checkpoint(fx["checkpoint"], batch_size=4)
    assert model.carried_batch_size == 4
    assert all(t.abs().sum() == 0 for t in model.carry_state().values())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same = ContinuousThoughtEngine.from_checkpoint(fx["checkpoint"], batch_size=2)
    assert torch.equal(same.thought_state, fx["checkpoint"]["model_state"]["thought_state"])


def test_mismatched_checkpoint_names_the_keys():
    model = make_engine()
    ckpt = legacy_dict(model, batch=1)
    state = dict(ckpt["model_state"])
    state.pop("blocks.0.attn.w_out")
    state["blocks.9.attn.extra"] = torch.zeros(1)
    state["blocks.1.moe.b1"] = torch.zeros(3, 3)
    with pytest.raises(ValueError) as err:
        ContinuousThoughtEngine.from_checkpoint({"model_state": state, "config": ckpt["config"]})
    message = str(err.value)
    assert "blocks.0.attn.w_out" in message and "blocks.9.attn.extra" in message
    assert "blocks.1.moe.b1 (3, 3)" in message
    with pytest.raises(ValueError, match="model_state"):
        ContinuousThoughtEngine.from_checkpoint({"weights": {}})


# --------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("bad,match", [
    (torch.zeros(2, 4), "integer dtype"),
    (torch.full((2, 4), TINY.vocab_size), r"\[0, 512\)"),
    (torch.full((2, 4), -1), r"\[0, 512\)"),
    (torch.zeros(8, dtype=torch.long), r"\(B, C\)"),
])
def test_bad_token_ids_are_refused_before_computing(bad, match):
    model = make_engine()
    before = model.carry_state()
    with pytest.raises(ValueError, match=match):
        model.tick_chunk_train(bad)
    for a, b in zip(before.values(), model.carry_state().values()):
        assert torch.equal(a, b)


def test_targets_are_checked_and_nan_propagates():
    model = make_engine()
    with pytest.raises(ValueError, match="targets"):
        model.tick_chunk_train_ce(tokens(2, 4), tokens(2, 5), ce_chunk=4)
    with torch.no_grad():
        model.observe.weight[7].fill_(float("nan"))
    obs = tokens(1, 4)
    obs[0, 2] = 7
    logits, lb = model.tick_chunk_train(obs)
    assert torch.isnan(logits).any()
    check_token_ids(torch.tensor([0, 511]), 512)


def test_config_presets_and_files(tmp_path):
    assert load_model_config("1b").n_experts == 128 and load_model_config("1b").d_model == 1280
    path = tmp_path / "m.json"
    path.write_text('{"vocab_size": 64, "d_model": 32, "n_heads": 2, "d_head": 16}')
    assert load_model_config(str(path)).vocab_size == 64
    with pytest.raises(ValueError, match="unknown model"):
        load_model_config("2b")
    with pytest.raises(ValueError, match="d_model must equal"):
        EngineConfig(d_model=100, n_heads=3, d_head=32)
