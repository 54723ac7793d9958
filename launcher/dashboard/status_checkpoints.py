"""What `status` says of each GPU's checkpoint, read from the pod's files: the newest record
of a worker's METRICS tail, a Ray node's checkpoint age, whether the checkpoint the manifest
names still holds the recorded bytes, and whether the hub holds it."""

from __future__ import annotations

import json
import stat
import time
from pathlib import Path

from launcher.pod.ckpt_index import CheckpointIndex
from launcher.pod.manifest import ManifestEntry, event_position
from launcher.paths import metrics_path

TAIL_BYTES = 64 * 1024


def last_metrics(path: Path) -> dict | None:
    return last_record(path, lambda record: record.get("type") == "metrics")


def last_record(path: Path, wanted) -> dict | None:
    """The newest `wanted` record of a METRICS file's tail (a FIFO is never opened)."""
    try:
        if not stat.S_ISREG(path.stat().st_mode):
            return None
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - TAIL_BYTES))
            lines = f.read().split(b"\n")
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if isinstance(record, dict) and wanted(record):
            return record
    return None


def node_checkpoint_age(pod_dir: Path, gpu: int, entry: ManifestEntry, live: dict,
                         now: float | None = None) -> float | None:
    """A Ray pod's checkpoint age from its nodes' events (waiting: the resume checkpoint's)."""
    def wanted(record: dict) -> bool:
        return record.get("event") == "checkpoint" and (
            live.get("state") != "waiting" or record.get("sha256") == entry.checkpoint_sha256)
    record = last_record(pod_dir / metrics_path(gpu), wanted)
    if record is None:
        return None
    saved = record["mtime_ns"] / 1e9 if record.get("mtime_ns") else record.get("ts")
    if not isinstance(saved, (int, float)):
        return None
    return (time.time() if now is None else now) - saved     # the clock after the read


def hub_tokens(pod_dir: Path) -> dict:
    """GPU (as a string) -> the token of its checkpoint in the last push to the hub."""
    # launcher.hub (its package, ~45 ms) only for a pod with a hub: `status` stays fast
    from launcher.hub.sync_state import read_sync_state
    tokens = read_sync_state(pod_dir).get("last_pushed_tokens")
    return tokens if isinstance(tokens, dict) else {}


def hub_note(entry: ManifestEntry, hub_tokens: dict | None, gpu: int) -> str | None:
    """With a hub, when the manifest's checkpoint is not on it: what the hub holds."""
    if hub_tokens is None or not entry.checkpoint or entry.hub_revision:
        return None
    held = hub_tokens.get(str(gpu))
    holds = (f"hub holds token {int(held):,}" if isinstance(held, (int, float))
             else "the hub holds none of its checkpoints")
    return (f"newest checkpoint (token {entry.start_token:,}) not on the hub yet (only "
            f"passed ones are pushed); {holds}")


def checkpoint_problem(pod_dir: Path, gpu: int, entry: ManifestEntry,
                        index: CheckpointIndex) -> str | None:
    """Why the manifest's checkpoint file is not the one it records (None: it is)."""
    rel, recorded = entry.checkpoint, entry.checkpoint_sha256
    if not rel:
        return None
    path = pod_dir / rel
    if not path.is_file():
        return f"{rel} is missing"
    if not recorded:
        return None
    try:
        actual = index.file_sha256(gpu, path, recorded)
    except OSError as exc:
        return f"{rel} cannot be read: {exc.strerror or exc}"
    if actual == recorded or any(r["sha256"] == actual for r in index.pending(gpu)):
        return None     # (or a newer checkpoint the running launcher is recording)
    if newer_save(pod_dir, gpu, actual, (entry.at_phase, entry.start_token or 0)):
        # The worker's own save, hashed before the launcher recorded it (a healthy pod's
        # polls meet it often); an older checkpoint put back still warns.
        return None
    return (f"{rel} does not hold the bytes the manifest records (sha256 {actual[:12]}..., "
            f"manifest {recorded[:12]}...): it was replaced after the launcher recorded it")


def newer_save(pod_dir: Path, gpu: int, sha256: str, recorded: tuple[int, int]) -> bool:
    """Whether these bytes are the worker's save past `recorded` (phase, token): in the
    index read now, or in a checkpoint event of the METRICS tail (read after hashing)."""
    if any(r["sha256"] == sha256 and event_position(r) > recorded
           for r in CheckpointIndex(pod_dir).for_gpu(gpu)):
        return True

    def newer(record: dict) -> bool:
        token = record.get("next_token")
        return (record.get("event") == "checkpoint" and record.get("sha256") == sha256
                and isinstance(token, int) and event_position(record) > recorded)
    return last_record(pod_dir / metrics_path(gpu), newer) is not None
