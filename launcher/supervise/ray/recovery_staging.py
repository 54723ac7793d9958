"""A node's staging folder of posted recovery saves, and when the node commits them.

Invariant: a node commits every GPU's newest posted save together, no more often than its
share of the hub's commit budget allows (a file:// store has none), and a worker's final
save at once. Owner: the node's recovery pushers (recovery.RecoveryPusher), which post
into the folder and commit from it one at a time under the node's lock.
"""
from __future__ import annotations

import time
from pathlib import Path

import psutil

from launcher.files import read_json_state
from launcher.hub.commit_budget import HOUR_S, HUB_COMMITS_PER_HOUR, recovery_commits_per_hour
from launcher.paths import RECOVERY_COMMIT_STATE, RECOVERY_POSTED_PREFIX, RECOVERY_PUSHER_PREFIX

# The budget: docs/LAUNCHER.md, Multi-node pods on Ray, Recovery copies.
GATHER_S = 10.0          # a due commit waits this long for the node's other GPUs' saves
# On a budget, a pusher with nothing new looks whether the node's commit is due this often
# (a look reads every posted record: 9 ms on a loaded machine, at 5 Hz 4.6 % of a core each)
DUE_CHECK_S = 2.0


def gpu_commit_every_s(hub_url: str | None, pod_gpus: int,
                       budget: int = HUB_COMMITS_PER_HOUR) -> float:
    """Seconds between two recovery commits each of `pod_gpus` GPUs is entitled to: on hf://
    the pod's recovery share of `budget` split over its GPUs; 0 for a file:// store."""
    if not hub_url or not hub_url.startswith("hf://"):
        return 0.0
    return HOUR_S / recovery_commits_per_hour(budget) * max(1, pod_gpus)


def commit_every_s(gpu_every_s: float, node_gpus: int) -> float:
    """How often a node commits for its `node_gpus` GPUs together, within the pod's share."""
    return gpu_every_s / max(1, node_gpus)


def posted(staging: Path) -> list[dict]:
    """The complete posted entries in `staging` (record written, weights beside it)."""
    found = []
    for path in staging.glob(f"{RECOVERY_POSTED_PREFIX}*.json"):
        doc = read_json_state(path)
        pt = path.with_suffix(".pt")
        if not pt.exists():          # removed (weights go last): a stale record
            path.unlink(missing_ok=True)
            continue
        if not isinstance(doc.get("record"), dict):
            continue
        found.append({**doc, "doc": doc, "gpu": doc["record"].get("gpu"), "name": path.stem,
                      "json": path, "pt": pt, "posted_at": float(doc.get("posted_at") or 0)})
    return found


def newest_per_gpu(entries: list[dict]) -> list[dict]:
    newest: dict[int, dict] = {}
    for entry in entries:
        if entry["gpu"] not in newest or entry["posted_at"] > newest[entry["gpu"]]["posted_at"]:
            newest[entry["gpu"]] = entry
    return sorted(newest.values(), key=lambda e: e["gpu"])


def remove_entry(entry: dict) -> None:
    entry["json"].unlink(missing_ok=True)           # first: the entry is no longer complete
    entry["pt"].unlink(missing_ok=True)


def node_gpus(staging: Path) -> int:
    """The GPUs of the pod whose pushers run on this node now."""
    gpus = set()
    for path in staging.glob(f"{RECOVERY_PUSHER_PREFIX}*.json"):
        doc = read_json_state(path)
        try:
            alive = psutil.Process(int(doc["pid"])).create_time() == doc["create_time"]
        except (KeyError, TypeError, ValueError, psutil.NoSuchProcess):
            alive = False
        if alive:
            gpus.add(doc.get("gpu"))
    return len(gpus)


def commit_due(staging: Path, gpu_every_s: float) -> bool:
    """A final save at once; else after the node's cadence, once every GPU of the node
    posted a save or GATHER_S after the oldest posted."""
    entries = posted(staging)
    if not entries:
        return False
    state = read_json_state(staging / RECOVERY_COMMIT_STATE)
    now = time.time()
    if now < float(state.get("retry_at") or 0):
        return False
    if any(e.get("final") for e in entries):
        return True
    gpus_here = node_gpus(staging)
    every = commit_every_s(gpu_every_s, gpus_here)
    if every == 0:
        return True
    if now < float(state.get("at") or 0) + every:
        return False
    return len({e["gpu"] for e in entries}) >= gpus_here \
        or now >= min(e["posted_at"] for e in entries) + GATHER_S
