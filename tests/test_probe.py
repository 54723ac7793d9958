"""The AR probe: deterministic, sensitive to the checkpoint, and it sees learning."""

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from fractus.config import PRESETS
from fractus.continuous_engine import ContinuousThoughtEngine
from fractus.data import TokenShard, synth
from fractus.eval.probe import ProbeConfig, probe_checkpoint, probe_windows

CFG = ProbeConfig(rows=2)


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    out = tmp_path_factory.mktemp("data")
    return synth(out, shards=1, tokens=60_000, vocab=PRESETS["tiny"].vocab_size, seed=0)[0]


def legacy(model, next_token):
    return {"model_state": model.state_dict(), "config": model.config.to_dict(),
            "train_state": {"next_token": next_token}}


def fresh(seed):
    torch.manual_seed(seed)
    return ContinuousThoughtEngine.from_config(PRESETS["tiny"])


def trained(shard_path, steps=100, batch=8, seq=32):
    model = fresh(0)
    model.set_gate_temperature(2.5)
    model.reset_thought(batch)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = TokenShard(shard_path)
    p = 0
    for _ in range(steps):
        window = data.window(p, batch * seq + 1).long()
        p += batch * seq
        obs, target = window[:-1].view(batch, seq), window[1:].view(batch, seq)
        logits, lb = model.tick_chunk_train(obs)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1)) + 0.02 * lb
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model, p


def test_probe_is_deterministic_and_depends_on_the_checkpoint(shard):
    ck_a, ck_b = legacy(fresh(1), 5000), legacy(fresh(2), 5000)
    first = probe_checkpoint(ck_a, shard, CFG)
    assert probe_checkpoint(ck_a, shard, CFG) == first
    other = probe_checkpoint(ck_b, shard, CFG)
    assert (other.ar, other.cold_tf) != (first.ar, first.cold_tf)
    assert first.start == 5000 and 0.0 <= first.ar_acc <= 1.0


def test_trained_checkpoint_has_lower_ar_than_a_fresh_one(shard):
    model, head = trained(shard)
    before = probe_checkpoint(legacy(fresh(0), head), shard, CFG)
    after = probe_checkpoint(legacy(model, head), shard, CFG)
    assert after.ar < 0.5 * before.ar, (before, after)
    assert after.cold_tf < before.cold_tf


def test_windows_fall_back_before_the_head_near_the_end():
    start, span = probe_windows(10_000, 9_990, CFG)
    assert start + span * CFG.rows <= 10_000 and start < 9_990
    with pytest.raises(ValueError, match="too short"):
        probe_windows(100, 0, CFG)


def test_probe_cli_json_and_bad_input(shard, tmp_path):
    path = tmp_path / "ck.pt"
    torch.save(legacy(fresh(3), 100), path)
    out = subprocess.run([sys.executable, "-m", "fractus.eval.probe", "--checkpoint", str(path),
                          "--shard", str(shard), "--rows", "2", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert set(result) >= {"ar", "ar_acc", "cold_tf"} and result["next_token"] == 100
    bad = subprocess.run([sys.executable, "-m", "fractus.eval.probe", "--checkpoint", str(path),
                          "--shard", str(tmp_path / "missing.npy")], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
