"""Token shards (memmap windows, legacy .pt, bad files) and the synthetic data CLI."""

import subprocess
import sys

import numpy as np
import pytest
import torch

from fractus.data import ShardError, TokenShard, batch_from_window, markov_chain, sample_chain
from tests.support.worker_utils import REPO_ROOT


@pytest.mark.parametrize("dtype", [np.int32, np.uint16])
def test_npy_window_is_the_exact_slice(tmp_path, dtype):
    tokens = np.arange(1000, dtype=dtype) % 500
    np.save(tmp_path / "s.npy", tokens)
    shard = TokenShard(tmp_path / "s.npy")
    assert len(shard) == 1000
    w = shard.window(123, 2 * 8 + 1)
    assert w.tolist() == tokens[123:140].astype(np.int64).tolist()
    chunk, target = batch_from_window(w, 2, 8)
    assert chunk.dtype == torch.int64 and chunk.shape == (2, 8)
    # target is the chunk shifted by one token, across the row boundary too
    assert torch.equal(chunk.reshape(-1)[1:], target.reshape(-1)[:-1])
    assert target.reshape(-1)[-1].item() == tokens[139]


def test_legacy_pt_shard(tmp_path):
    tokens = torch.arange(300, dtype=torch.int64)
    torch.save(tokens, tmp_path / "s.pt")
    shard = TokenShard(tmp_path / "s.pt")
    assert len(shard) == 300 and shard.window(10, 5).tolist() == [10, 11, 12, 13, 14]


@pytest.mark.parametrize("make, message", [
    (lambda p: np.save(p, np.zeros(10, dtype=np.float32)), "integer array"),
    (lambda p: np.save(p, np.zeros((2, 5), dtype=np.int32)), "1-D"),
    (lambda p: p.write_bytes(b"not numpy"), "not a readable"),
])
def test_bad_npy_is_a_shard_error(tmp_path, make, message):
    path = tmp_path / "bad.npy"
    make(path)
    with pytest.raises(ShardError, match=message):
        TokenShard(path)


def test_missing_and_unknown_suffix(tmp_path):
    with pytest.raises(ShardError, match="not found"):
        TokenShard(tmp_path / "nope.npy")
    (tmp_path / "s.bin").write_bytes(b"x")
    with pytest.raises(ShardError, match=".npy or .pt"):
        TokenShard(tmp_path / "s.bin")


def test_window_outside_the_shard(tmp_path):
    np.save(tmp_path / "s.npy", np.zeros(10, dtype=np.int32))
    with pytest.raises(IndexError):
        TokenShard(tmp_path / "s.npy").window(5, 6)


def test_markov_chain_is_learnable():
    """The stream follows the chain: every transition is one of the token's 4 successors."""
    successors, cum = markov_chain(64, seed=3)
    stream = sample_chain(successors, cum, 5000, np.random.default_rng(0), lanes=10)
    pairs = zip(stream[:-1], stream[1:])
    allowed = sum(int(b in successors[a]) for a, b in pairs)
    # only the 9 lane boundaries may jump anywhere
    assert allowed >= len(stream) - 1 - 9


def test_synth_cli_writes_shards(tmp_path):
    out = tmp_path / "data"
    proc = subprocess.run([sys.executable, "-m", "fractus.data", "synth", "--out", str(out),
                           "--shards", "3", "--tokens", "5000", "--vocab", "100", "--seed", "7"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    shards = [np.load(out / f"shard_phase2_gpu{i}.npy") for i in range(3)]
    for s in shards:
        assert s.dtype == np.int32 and s.shape == (5000,) and 0 <= s.min() and s.max() < 100
    assert not np.array_equal(shards[0], shards[1])  # a different walk per shard
    again = tmp_path / "again"
    subprocess.run([sys.executable, "-m", "fractus.data", "synth", "--out", str(again),
                    "--shards", "1", "--tokens", "5000", "--vocab", "100", "--seed", "7"],
                   cwd=REPO_ROOT, check=True, capture_output=True, timeout=60)
    assert np.array_equal(np.load(again / "shard_phase2_gpu0.npy"), shards[0])  # reproducible
    bad = subprocess.run([sys.executable, "-m", "fractus.data", "synth", "--out", str(again),
                          "--vocab", "1"], cwd=REPO_ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.startswith("error:")
