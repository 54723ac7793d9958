"""A worker's save without a worker: a checkpoint of one GPU at a token, written as the
worker writes it (a rename over its one name), and the checkpoint event it would log."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from launcher.files import sha256_file


def write_save(workdir: Path, gpu: int, token: int, value: float | None = None,
               name: str = "checkpoints/fractus_1b_gpu{gpu}.pt", run_id: str = "run-a") -> dict:
    """GPU `gpu`'s save at `token` (its weights all `value`, else the token) in `workdir`;
    its checkpoint event, the file's absolute path in it."""
    path = workdir / name.format(gpu=gpu)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    fill = float(token) if value is None else value
    torch.save({"model_state": {"w": torch.full((4,), fill)}, "config": {"gpu": gpu},
                "train_state": {"gpu": gpu, "next_token": token, "run_id": run_id},
                "optimizer_state": {}}, tmp)
    tmp.replace(path)
    return {"type": "event", "event": "checkpoint", "path": str(path),
            "sha256": sha256_file(path), "next_token": token, "ts": time.time()}
