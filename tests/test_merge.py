"""launcher.hub.merge: mean of floating tensors, integer buffers from GPU 0, carried state dropped."""

from pathlib import Path

import pytest
import torch

from launcher.hub.merge import is_carried_state, merge_checkpoints


def _legacy_checkpoint(legacy_fixture_dir: Path) -> dict:
    return torch.load(legacy_fixture_dir / "lowrank_sparse.pt", weights_only=True)["checkpoint"]


def _gpu_variants(base: dict, n: int, tmp_path: Path, prefix: str = "") -> list[Path]:
    """n checkpoints derived from `base`: perturbed floats, distinct carried state and batch sizes."""
    paths = []
    for gpu in range(n):
        gen = torch.Generator().manual_seed(gpu)
        state = {}
        for key, t in base["model_state"].items():
            if is_carried_state(key) and t.dim() > 0:
                # Carried state has this GPU's batch size: shapes differ across GPUs.
                t = torch.randn((gpu + 1, *t.shape[1:]), generator=gen)
            elif t.is_floating_point():
                t = t + torch.randn(t.shape, generator=gen)
            state[prefix + key] = t
        state[prefix + "observe.weight"] = state[prefix + "observe.weight"].contiguous()
        state[prefix + "output_head.weight"] = state[prefix + "observe.weight"]  # tied, as saved
        state[prefix + "step_counter"] = torch.tensor(100 + gpu, dtype=torch.int64)
        path = tmp_path / f"fractus_1b_gpu{gpu}.pt"
        torch.save({"model_state": state, "config": {**base["config"], "gpu": gpu}}, path)
        paths.append(path)
    return paths


def test_is_carried_state_matches_only_carried_buffers():
    for key in ["thought_state", "last_lb_loss", "blocks.3.attn_S", "blocks.0.attn_z",
                "blocks.15.kuramoto_phases", "_orig_mod.thought_state", "_orig_mod.blocks.1.attn_S"]:
        assert is_carried_state(key), key
    for key in ["observe.weight", "blocks.0.attn.w_qkv", "blocks.0.kuramoto.omega",
                "blocks.0.moe.expert_phases", "attn_S_scale.weight"]:
        assert not is_carried_state(key), key


def test_merge_is_the_mean_of_floats_with_ints_from_gpu0(legacy_fixture_dir, tmp_path):
    base = _legacy_checkpoint(legacy_fixture_dir)
    paths = _gpu_variants(base, 3, tmp_path)
    out = tmp_path / "merged" / "FRACTUS_1B_8GPU_MERGED.pt"

    report = merge_checkpoints(paths, out)

    merged = torch.load(out, weights_only=True)
    assert set(merged) == {"model_state", "config"}
    assert merged["config"] == torch.load(paths[0], weights_only=True)["config"]
    states = [torch.load(p, weights_only=True)["model_state"] for p in paths]
    state = merged["model_state"]
    for key, t in states[0].items():
        if is_carried_state(key):
            assert key not in state, key
        elif t.is_floating_point():
            expected = torch.stack([s[key].double() for s in states]).mean(0).to(t.dtype)
            torch.testing.assert_close(state[key], expected, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(state[key], t), key
    assert state["step_counter"].item() == 100  # from GPU 0, not averaged
    assert report.n_checkpoints == 3 and "thought_state" in report.dropped
    # The tied head stays tied: one storage for both keys.
    assert state["output_head.weight"].data_ptr() == state["observe.weight"].data_ptr()


def test_merge_keeps_orig_mod_prefix_and_bf16(tmp_path):
    paths = []
    for gpu, value in enumerate([1.0, 2.0, 4.0]):
        state = {
            "_orig_mod.w": torch.full((4, 4), value, dtype=torch.bfloat16),
            "_orig_mod.thought_state": torch.zeros(gpu + 1, 1, 4),
        }
        torch.save({"model_state": state, "config": {"gpu": gpu}}, tmp_path / f"g{gpu}.pt")
        paths.append(tmp_path / f"g{gpu}.pt")

    merge_checkpoints(paths, tmp_path / "m.pt")

    state = torch.load(tmp_path / "m.pt", weights_only=True)["model_state"]
    assert list(state) == ["_orig_mod.w"]
    assert state["_orig_mod.w"].dtype == torch.bfloat16
    # Summed in float32, rounded to bf16 once at the end.
    assert torch.equal(state["_orig_mod.w"], torch.full((4, 4), 7 / 3).to(torch.bfloat16))


def test_merge_refuses_mismatched_checkpoints_and_leaves_no_output(tmp_path):
    torch.save({"model_state": {"w": torch.ones(2, 2)}, "config": {}}, tmp_path / "a.pt")
    torch.save({"model_state": {"w": torch.ones(3, 2)}, "config": {}}, tmp_path / "b.pt")
    torch.save({"model_state": {"v": torch.ones(2, 2)}, "config": {}}, tmp_path / "c.pt")
    out = tmp_path / "m.pt"
    with pytest.raises(ValueError, match="expected"):
        merge_checkpoints([tmp_path / "a.pt", tmp_path / "b.pt"], out)
    with pytest.raises(ValueError, match="does not match"):
        merge_checkpoints([tmp_path / "a.pt", tmp_path / "c.pt"], out)
    assert not out.exists()
    assert list(tmp_path.glob(".m.pt*")) == []


class Payload:
    """Loading this needs unpickling code from the test module: weights_only must refuse it."""


def test_merge_refuses_a_checkpoint_that_is_not_a_weights_only_dict(tmp_path):
    torch.save({"model_state": {"w": torch.ones(1)}, "config": {}}, tmp_path / "a.pt")
    torch.save({"model_state": {"w": torch.ones(1)}, "evil": Payload()}, tmp_path / "b.pt")
    with pytest.raises(ValueError, match="cannot load checkpoint"):
        merge_checkpoints([tmp_path / "a.pt", tmp_path / "b.pt"], tmp_path / "m.pt")
