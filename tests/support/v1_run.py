"""A replica of the user's real run directory, as the reference trainer leaves it.

Their repo root with their own `fractus/` package (here a decoy whose import fails) beside
`scripts/`; v1 checkpoints `checkpoints/fractus_1b_gpu{i}.pt` saved as
`{"model_state", "config"}` (v1's TARGET keys with no `vocab_size`: 50257 implied; GPU 1's
keys carry `_orig_mod.`); `.pt` shards `data/shard_gpu{i}.pt` (1-D int64); the tracker's
`checkpoints/RESUME_MANIFEST_8GPU.json` (`{"gpu_i": {"start_token"}}`) and the older root
`RESUME_MANIFEST.json` (`{"gpus": {...}, "step_tokens", "surgery"}`).

The model has the tiny preset's shape with v1's vocabulary (50257), so the implied vocab is
exercised and a CPU step stays fast.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from fractus.config import PRESETS
from fractus.continuous_engine import ContinuousThoughtEngine
from fractus.data import markov_chain, sample_chain

V1_VOCAB = 50257
# The tiny preset's shape, as v1 writes a config: its TARGET keys, no vocab_size.
TARGET = {k: v for k, v in dataclasses.asdict(PRESETS["tiny"]).items() if k != "vocab_size"}
START_TOKENS = {0: 320, 1: 640}
SHARD_TOKENS = 30_000


def v1_model(seed: int) -> ContinuousThoughtEngine:
    torch.manual_seed(seed)
    return ContinuousThoughtEngine(vocab_size=V1_VOCAB, **TARGET)


def write_v1_checkpoint(path: Path, gpu: int, seed: int, compiled_prefix: bool = False,
                        config: dict | None = None) -> Path:
    state = v1_model(seed).state_dict()
    if compiled_prefix:
        state = {f"_orig_mod.{k}": v for k, v in state.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model_state": state,
                "config": {**(config or TARGET), "gpu": gpu, "boost": True, "batch": 4,
                           "lr": 7e-4, "ss_rate": 0.25,
                           "tokens_processed": START_TOKENS.get(gpu, 0)}}, path)
    return path


def write_pt_shard(path: Path, seed: int, tokens: int = SHARD_TOKENS) -> Path:
    import numpy as np
    successors, cumweights = markov_chain(512, 0)
    stream = sample_chain(successors, cumweights, tokens, np.random.default_rng(seed))
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(torch.from_numpy(stream.astype("int64")), path)
    return path


def add_decoy_package(run: Path) -> None:
    """The user's own `fractus/` package in their run directory: importing it fails."""
    (run / "fractus").mkdir(exist_ok=True)
    (run / "fractus" / "__init__.py").write_text(
        'raise ImportError("decoy fractus package from the pod directory was imported")\n')
    (run / "scripts").mkdir(exist_ok=True)
    (run / "scripts" / "fast4gpu_boost.py").write_text("# the user's v1 trainer\n")


def v1_run(run: Path, gpus=(0, 1)) -> Path:
    """The replica: checkpoints, shards, both manifest layouts (they agree), the decoy."""
    run.mkdir(parents=True, exist_ok=True)
    add_decoy_package(run)
    for gpu in gpus:
        write_v1_checkpoint(run / f"checkpoints/fractus_1b_gpu{gpu}.pt", gpu, seed=10 + gpu,
                            compiled_prefix=(gpu == 1))
        write_pt_shard(run / f"data/shard_gpu{gpu}.pt", seed=gpu)
    (run / "checkpoints/RESUME_MANIFEST_8GPU.json").write_text(json.dumps(
        {f"gpu_{gpu}": {"start_token": START_TOKENS[gpu]} for gpu in gpus}, indent=2))
    (run / "RESUME_MANIFEST.json").write_text(json.dumps({
        "saved_at_utc": "2026-08-16T18:19:21+00:00", "step_tokens": 256,
        "surgery": {"gate_temp": 2.5, "lb_coef": 0.02},
        "gpus": {str(gpu): {"tokens_processed": START_TOKENS[gpu],
                            "start_token": START_TOKENS[gpu], "last_loss": 30.3,
                            "checkpoint": f"checkpoints/fractus_1b_gpu{gpu}.pt",
                            "shard": f"data/shard_gpu{gpu}.pt"} for gpu in gpus}}, indent=2))
    return run
