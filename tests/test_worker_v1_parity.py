"""The v2 worker equals v1 (scripts/fast4gpu_boost.py of the reference repo) on v1's own
variables: SHARD's default and .npy fallback, CKPT_IN's fallback chain, any integer .npy,
a bare state_dict; and never trains a random model unless ALLOW_FRESH_START=1 says so."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fractus.config import PRESETS
from fractus.continuous_engine import ContinuousThoughtEngine
from fractus.data import TokenShard
from fractus.train.env import WorkerSettings
from tests.support.worker_utils import (events, metrics_lines, read_jsonl, run_worker,
                                        worker_env, write_synth_shard)


def test_shard_default_is_v1s_with_its_npy_fallback(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    settings = WorkerSettings.from_env({"GPU_ID": "3"})
    assert settings.shard_path == "data/shard_gpu3.pt"          # nothing there: named as is
    (tmp_path / "data").mkdir()
    np.save(tmp_path / "data" / "shard_gpu3.npy", np.arange(10, dtype=np.int32))
    assert settings.shard_path == "data/shard_gpu3.npy"
    torch.save(torch.arange(10), tmp_path / "data" / "shard_gpu3.pt")
    assert settings.shard_path == "data/shard_gpu3.pt"
    explicit = WorkerSettings.from_env({"SHARD": "data/other.pt"})
    np.save(tmp_path / "data" / "other.npy", np.arange(10, dtype=np.int32))
    assert explicit.shard_path == "data/other.npy"               # v1 falls back for any .pt


@pytest.mark.parametrize("dtype", [np.int64, np.uint32, np.int16, np.uint8])
def test_any_integer_npy_is_read_window_by_window(tmp_path, dtype):
    tokens = (np.arange(5000) % 250).astype(dtype)
    np.save(tmp_path / "s.npy", tokens)
    shard = TokenShard(tmp_path / "s.npy")
    window = shard.window(1234, 33)
    assert window.tolist() == tokens[1234:1267].astype(np.int64).tolist()
    assert isinstance(shard._tokens, np.memmap)        # the shard itself is never converted


def _legacy_file(path, seed: int = 0, bare: bool = False):
    """A v1-format file of the tiny model: {"model_state", "config"} or a bare state_dict."""
    torch.manual_seed(seed)
    model = ContinuousThoughtEngine(**PRESETS["tiny"].to_dict())
    state = {f"_orig_mod.{k}": v for k, v in model.state_dict().items()}   # compiled, as v1
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state if bare else {"model_state": state, "config": PRESETS["tiny"].to_dict()},
               path)
    return path


def test_no_checkpoint_is_refused_unless_a_fresh_start_is_asked_for(tmp_path):
    shard = write_synth_shard(tmp_path / "shard.npy", tokens=3000)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = worker_env(run_dir, SHARD=shard, MAX_STEPS=1, CKPT_OUT=None, METRICS=None,
                     ALLOW_FRESH_START=None)
    refused = run_worker(env, cwd=run_dir)
    assert refused.returncode == 2
    assert refused.stderr.count("\n") == 1 and "ALLOW_FRESH_START=1" in refused.stderr
    assert "checkpoints/fractus_1b_gpu0.pt" in refused.stderr
    assert list(run_dir.iterdir()) == []                        # nothing written
    fresh = run_worker({**env, "ALLOW_FRESH_START": "1"}, cwd=run_dir)
    assert fresh.returncode == 0, fresh.stderr
    assert (run_dir / "checkpoints" / "fractus_1b_gpu0.pt").is_file()


def test_unset_ckpt_in_falls_back_to_the_merged_brain(tmp_path):
    shard = write_synth_shard(tmp_path / "shard.npy", tokens=3000)
    run_dir = tmp_path / "run"
    _legacy_file(run_dir / "checkpoints" / "FRACTUS_1B_STAGE2_MERGED.pt")
    env = worker_env(run_dir, SHARD=shard, MAX_STEPS=1, CKPT_OUT=None, ALLOW_FRESH_START=None)
    no_token = run_worker(env, cwd=run_dir)        # weights only: the token must be given
    assert no_token.returncode == 2 and "START_TOKEN is required" in no_token.stderr
    done = run_worker({**env, "START_TOKEN": "64"}, cwd=run_dir)
    assert done.returncode == 0, done.stderr
    (start,) = events(read_jsonl(env["METRICS"]), "start")
    assert start["resume"] == "legacy" and start["next_token"] == 64
    assert start["source"] == "checkpoints/FRACTUS_1B_STAGE2_MERGED.pt"
    assert "[boost]" in done.stdout                 # the v1 tag on the human line


def test_bare_state_dict_trains_like_the_same_weights_in_a_v1_file(tmp_path):
    shard = write_synth_shard(tmp_path / "shard.npy", tokens=3000)
    first_losses = []
    for name, bare in (("v1", False), ("bare", True)):
        ckpt = _legacy_file(tmp_path / name / "in.pt", seed=7, bare=bare)
        env = worker_env(tmp_path / name, SHARD=shard, MAX_STEPS=2, CKPT_IN=ckpt,
                         START_TOKEN=96, ALLOW_FRESH_START=None)
        done = run_worker(env)
        assert done.returncode == 0, done.stderr
        first_losses.append([m["tf"] for m in metrics_lines(read_jsonl(env["METRICS"]))])
    assert first_losses[0] == first_losses[1]
    bare_ckpt = _legacy_file(tmp_path / "wrong" / "in.pt", bare=True)
    env = worker_env(tmp_path / "wrong", SHARD=shard, MAX_STEPS=1, CKPT_IN=bare_ckpt,
                     START_TOKEN=0, MODEL="small")       # MODEL says another shape: refused
    refused = run_worker(env)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1
