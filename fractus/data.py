"""Token shards: zero-copy access for training, and learnable synthetic shards for demos.

A shard is one flat stream of token ids: `.npy` (int32 in production, any integer dtype)
or v1's 1-D `.pt`, both memory-mapped and read a window per step, so memory does not grow
with the shard (v1 converted it whole to int64: 3.4 GB per process). `synth` writes
shards from one fixed sparse Markov chain: a model's loss visibly falls toward its entropy.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
import torch

# Windows of these dtypes stay int32 on the host (exact); any other integer dtype is
# widened to int64 per window (as v1 did for the whole shard).
INT32_EXACT = (np.dtype(np.int8), np.dtype(np.uint8), np.dtype(np.int16),
               np.dtype(np.uint16), np.dtype(np.int32))


class ShardError(ValueError):
    """A missing or malformed shard file: a user mistake, reported as one line."""


class TokenShard:
    """Read-only view of a token stream; `window(p, n)` returns tokens [p, p+n) on the CPU."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.exists():
            raise ShardError(f"shard not found: {self.path}")
        if not self.path.is_file():    # never opened: a FIFO would block the reader
            kind = "a directory" if self.path.is_dir() else "a FIFO, socket or device"
            raise ShardError(f"shard {self.path} is {kind}, not a regular file")
        if self.path.suffix == ".npy":
            self._tokens = self._open_npy(self.path)
        elif self.path.suffix == ".pt":
            self._tokens = self._open_pt(self.path)
        else:
            raise ShardError(f"shard {self.path}: expected a .npy or .pt file")

    @staticmethod
    def _open_npy(path: Path) -> np.ndarray:
        try:
            tokens = np.load(path, mmap_mode="r")
        except (ValueError, OSError, EOFError) as e:   # EOFError: an empty or cut file
            raise ShardError(f"shard {path}: not a readable .npy file ({e})") from None
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ShardError(f"shard {path}: expected a 1-D integer array, "
                             f"got {tokens.dtype} with shape {tokens.shape}")
        return tokens

    @staticmethod
    def _open_pt(path: Path) -> torch.Tensor:
        try:
            try:  # memory-mapped: a window reads its own pages, never the whole shard
                tokens = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError:  # torch's pre-zip format cannot be mapped: read it whole
                tokens = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # any unpickling failure is a bad file, not a crash
            raise ShardError(f"shard {path}: not a loadable tensor file "
                             f"({str(e).strip().splitlines()[0] if str(e).strip() else e!r})"
                             ) from None
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or tokens.is_floating_point():
            raise ShardError(f"shard {path}: expected a 1-D integer tensor")
        return tokens

    def __len__(self) -> int:
        return int(self._tokens.shape[0])

    def window(self, start: int, length: int) -> torch.Tensor:
        """Tokens [start, start+length) copied out as a small CPU tensor (int32 or int64)."""
        if start < 0 or start + length > len(self):
            raise IndexError(f"window [{start}, {start + length}) outside shard of {len(self)}")
        piece = self._tokens[start:start + length]
        if isinstance(piece, torch.Tensor):
            return piece.clone()
        dtype = np.int32 if piece.dtype in INT32_EXACT else np.int64
        return torch.from_numpy(np.array(piece, dtype=dtype))


def batch_from_window(window_dev: torch.Tensor, batch: int, seq: int):
    """Split B*SEQ+1 tokens (already on the device) into (chunk, target), both (B, SEQ) long."""
    tokens = window_dev.long()
    n = batch * seq
    return tokens[:n].view(batch, seq), tokens[1:n + 1].view(batch, seq)


# --- synthetic learnable shards -----------------------------------------------------------

def markov_chain(vocab: int, seed: int, fanout: int = 4):
    """A fixed random sparse chain: each token has `fanout` successors with Dirichlet weights."""
    rng = np.random.default_rng(seed)
    successors = rng.integers(0, vocab, size=(vocab, fanout))
    weights = rng.dirichlet(np.full(fanout, 0.5), size=vocab)
    return successors, np.cumsum(weights, axis=1)


def sample_chain(successors: np.ndarray, cumweights: np.ndarray, n_tokens: int,
                 rng: np.random.Generator, lanes: int = 1024) -> np.ndarray:
    """n_tokens from the chain. `lanes` independent walks advance together (vectorised);
    their segments are concatenated, so the stream has one random jump per segment."""
    vocab, fanout = successors.shape
    lanes = max(1, min(lanes, n_tokens))
    length = -(-n_tokens // lanes)
    out = np.empty((lanes, length), dtype=np.int32)
    state = rng.integers(0, vocab, size=lanes)
    for t in range(length):
        out[:, t] = state
        u = rng.random(lanes)[:, None]
        choice = np.minimum((u > cumweights[state]).sum(axis=1), fanout - 1)
        state = successors[state, choice]
    return out.reshape(-1)[:n_tokens]


def write_npy_atomic(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with open(tmp, "wb") as f:
        np.save(f, array)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def synth(out: Path, shards: int, tokens: int, vocab: int, seed: int) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    successors, cumweights = markov_chain(vocab, seed)
    paths = []
    for i in range(shards):
        rng = np.random.default_rng([seed, i])  # same chain, a different walk per shard
        path = out / f"shard_phase2_gpu{i}.npy"
        write_npy_atomic(path, sample_chain(successors, cumweights, tokens, rng))
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fractus.data")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("synth", help="write learnable synthetic int32 shards")
    s.add_argument("--out", type=Path, required=True)
    s.add_argument("--shards", type=int, default=8)
    s.add_argument("--tokens", type=int, default=1_000_000, help="tokens per shard")
    s.add_argument("--vocab", type=int, default=512)
    s.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.shards < 1 or args.tokens < 2 or not 2 <= args.vocab <= 2**31 - 1 or args.seed < 0:
        print("error: need --shards >= 1, --tokens >= 2, --vocab >= 2, --seed >= 0",
              file=sys.stderr)
        return 2
    for path in synth(args.out, args.shards, args.tokens, args.vocab, args.seed):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
