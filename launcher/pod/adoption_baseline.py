"""The adoption baseline: the user's original checkpoints, kept for good (nothing in
fractus-pod deletes checkpoints/adopted/). Owner: `adopt` (setup_adopt.py) records it once.
Each is hard-linked outside the worker's rotation and retained/'s pruning, which would both
let it go, and listed in checkpoints/adopted/adoption.json.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from launcher.paths import ADOPTION_DIR
from launcher.pod.ckpt_index import link_or_copy
from launcher.files import atomic_write_text

ADOPTION_RECORD = f"{ADOPTION_DIR}/adoption.json"


def read_adoption(pod_dir: Path) -> list[dict]:
    """The recorded baselines (gpu, checkpoint, kept, sha256, start_token, shard, ...)."""
    path = pod_dir / ADOPTION_RECORD
    if not path.is_file():
        return []
    return json.loads(path.read_text()).get("baselines", [])


def record_adoption(pod_dir: Path, gpus: list[tuple[int, str, str, int, str, str]]) -> None:
    """Keep each (gpu, checkpoint, sha256, start_token, shard, shard_sha256) not yet kept."""
    records = read_adoption(pod_dir)
    changed = False
    for gpu, checkpoint, sha256, start_token, shard, shard_sha256 in gpus:
        if any(r["gpu"] == gpu and r["sha256"] == sha256 for r in records):
            continue
        kept = f"{ADOPTION_DIR}/gpu{gpu}-token{start_token}-{sha256[:12]}.pt"
        link_or_copy(pod_dir / checkpoint, pod_dir / kept)
        records.append({"gpu": gpu, "checkpoint": checkpoint, "kept": kept, "sha256": sha256,
                        "start_token": start_token, "shard": shard,
                        "shard_sha256": shard_sha256, "adopted_at": time.time()})
        changed = True
    if changed:
        atomic_write_text(pod_dir / ADOPTION_RECORD,
                          json.dumps({"baselines": records}, indent=2) + "\n")
