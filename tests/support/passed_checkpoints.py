"""Checkpoints as the worker writes them, passed and named by the manifest, without training:
random bytes (what a hub push moves and stores), for the hub retention tests and benchmark."""

from __future__ import annotations

import os
from pathlib import Path

from launcher.config.podconfig import load_pod_config
from launcher.pod.ckpt_index import PASSED, CheckpointIndex
from launcher.files import sha256_file
from launcher.pod.manifest import apply_checkpoint, read_manifest, write_manifest


def new_checkpoints(pod: Path, token: int, size: int, gpus, stage: int = 1,
                    phase: int = 1) -> None:
    """Each of `gpus` gets its next checkpoint of `size` random bytes at `token` of data
    phase `phase`, passed, in the checkpoint index and the manifest (as the launcher records
    them); every GPU of the manifest is at `stage` (a stage switch moves them all)."""
    config = load_pod_config(pod)
    manifest = read_manifest(pod / config.manifest)
    index = CheckpointIndex(pod)
    for gpu in gpus:
        path = pod / config.checkpoint_path(gpu)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(os.urandom(size))
        os.replace(tmp, path)
        event = {"path": str(path), "sha256": sha256_file(path), "next_token": token,
                 "step": token // 32, "ema_tf": 5.0, "lb": 1.0, "bytes": size,
                 "phase": phase}
        index.add(gpu, event, stage, config.checkpoint_path(gpu))
        index.mark(gpu, event["sha256"], PASSED, "test")
        apply_checkpoint(manifest, gpu, event, stage, pod, config.shard_path(gpu, phase))
    manifest.set_stage(stage)
    write_manifest(manifest)
