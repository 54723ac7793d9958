"""Helpers to run the worker as a real subprocess in tests (the launcher's tests may reuse them).

    shard = write_synth_shard(tmp_path / "shard.npy", tokens=4000)
    env = worker_env(tmp_path, SHARD=shard, MAX_STEPS=4)
    proc = run_worker(env)
    assert proc.returncode == 0
    events = read_jsonl(env["METRICS"])
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[2]
ENTRY = REPO_ROOT / "scripts" / "fast4gpu_boost_v2.py"

# Small, fast, deterministic defaults: the tiny preset on the CPU with one thread.
TEST_DEFAULTS = {
    "MODEL": "tiny", "DEVICE": "cpu", "BATCH": "2", "SEQ": "16", "SEED": "1234",
    "LOG_EVERY": "1", "SAVE_EVERY": "0", "GPU_ID": "0",
    "ALLOW_FRESH_START": "1",     # tests of a fresh start's refusal remove it
}


def write_synth_shard(path: Path, tokens: int = 4096, vocab: int = 512, seed: int = 0,
                      dtype=np.int32) -> Path:
    """A learnable shard from the synthetic Markov chain (fractus.data)."""
    from fractus.data import markov_chain, sample_chain
    successors, cumweights = markov_chain(vocab, seed)
    stream = sample_chain(successors, cumweights, tokens, np.random.default_rng(seed))
    path.parent.mkdir(parents=True, exist_ok=True)
    np.save(path, stream.astype(dtype))
    return path


def worker_env(tmp_path: Path, **overrides) -> dict:
    """Environment for one worker: test defaults, files under tmp_path, then overrides.

    An override of None removes the variable."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("FRACTUS_FAULT", "START_TOKEN", "CKPT_IN", "FORCE_START_TOKEN",
                        "ALLOW_FRESH_START")}
    env.update(TEST_DEFAULTS)
    env.update({
        "CKPT_OUT": str(tmp_path / "checkpoints" / "fractus_1b_gpu0.pt"),
        "METRICS": str(tmp_path / "metrics.jsonl"),
        "SHARD": str(tmp_path / "shard.npy"),
        # one thread: bitwise-reproducible runs and no fight for the CPU cores
        "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
    })
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = str(value)
    return env


def worker_command() -> list[str]:
    return [sys.executable, "-u", str(ENTRY)]


def run_worker(env: dict, timeout: float = 120, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(worker_command(), env=env, cwd=cwd or REPO_ROOT, capture_output=True,
                          text=True, timeout=timeout)


def start_worker(env: dict, cwd: Path | None = None, **popen_kwargs) -> subprocess.Popen:
    kwargs = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    kwargs.update(popen_kwargs)
    return subprocess.Popen(worker_command(), env=env, cwd=cwd or REPO_ROOT, **kwargs)


def wait_for_line(child: subprocess.Popen, text: str, timeout: float = 90) -> str:
    """Read the child's stderr pipe until a line holding `text` arrives; return what was read.
    Fails at once if the child closes it (exits) first, or after `timeout` seconds."""
    read, deadline = b"", time.monotonic() + timeout
    fd = child.stderr.fileno()
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while text.encode() not in read.rpartition(b"\n")[0]:
            left = deadline - time.monotonic()
            assert left > 0, f"no stderr line with {text!r} in {timeout}s:\n{read.decode()}"
            if selector.select(left):
                chunk = os.read(fd, 65536)
                assert chunk, f"the child closed stderr without {text!r}:\n{read.decode()}"
                read += chunk
    return read.decode()


def read_jsonl(path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def events(records: list[dict], name: str | None = None) -> list[dict]:
    return [r for r in records if r["type"] == "event" and (name is None or r["event"] == name)]


def metrics_lines(records: list[dict]) -> list[dict]:
    return [r for r in records if r["type"] == "metrics"]


def load_ckpt(path) -> dict:
    import torch
    return torch.load(path, map_location="cpu", weights_only=True)
