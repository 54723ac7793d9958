"""Files the running launcher shares with the other commands, each with one writer:
logs/pod_state.json (the running launcher's, read by `status`), logs/rollback_request.json
(`rollback`'s, for the launcher it names) and logs/stop_request.json (`stop`'s, early).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

from launcher.paths import STATE_FILE, REQUEST_FILE, STOP_REQUEST_FILE
from launcher.files import atomic_write_text, read_json_state, write_json_state


@dataclass(frozen=True)
class GpuSnapshot:
    """One GPU as `status` shows it."""
    pid: int | None
    device: str
    node: str | None
    state: str
    exit_code: int | None
    restarts: int
    verdict: str | None
    reason: str | None
    checks: dict
    last_error: str | None
    peers: dict = field(default_factory=dict)    # kind -> the mark (launcher/checks/peers.py)


@dataclass(frozen=True)
class PodSnapshot:
    """The running pod as `status` shows it (taken by launcher/supervise/pod_view.py)."""
    pod_state: str
    stage: int
    stage_name: str
    reason: str
    started_at: float
    rolled_back: bool
    gpus: dict[int, GpuSnapshot]
    # The checkpoints are on the nodes (a Ray pod), not on this machine's disk.
    checkpoints_on_nodes: bool = False


def pod_state_dict(snapshot: PodSnapshot) -> dict:
    return {"launcher_pid": os.getpid(), "pod_state": snapshot.pod_state,
            "stage": snapshot.stage, "stage_name": snapshot.stage_name,
            "reason": snapshot.reason, "started_at": snapshot.started_at,
            "updated_at": time.time(), "rolled_back": snapshot.rolled_back,
            "checkpoints_on_nodes": snapshot.checkpoints_on_nodes,
            "gpus": {str(gpu): _fields(g) for gpu, g in snapshot.gpus.items()}}


def _fields(gpu: GpuSnapshot) -> dict:
    """Shallow: the snapshot is fresh and plain (asdict's deep copy took 0.2 s of a 90 s
    profile on Ray with 16 GPUs; docs/BENCHMARKS.md)."""
    return {f.name: getattr(gpu, f.name) for f in fields(gpu)}


def write_pod_state(pod_dir: Path, snapshot: PodSnapshot) -> None:
    # No indent: the C encoder (this file is rewritten every few seconds; status pretty-prints).
    write_json_state(pod_dir / STATE_FILE, pod_state_dict(snapshot))


def read_pod_state(pod_dir: Path) -> dict | None:
    return read_json_state(pod_dir / STATE_FILE) or None


def write_rollback_request(pod_dir: Path, to_stage: int, gpus: list[int],
                           launcher_id: str | None = None) -> Path:
    """`launcher_id`: the launcher it is asked of (the lock holder's); no other takes it."""
    path = pod_dir / REQUEST_FILE
    atomic_write_text(path, json.dumps({"to_stage": to_stage, "gpus": gpus,
                                        "launcher_id": launcher_id,
                                        "ts": time.time()}) + "\n")
    return path


def take_rollback_request(pod_dir: Path) -> dict | None:
    path = pod_dir / REQUEST_FILE
    try:
        request = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError:
        request = None
    path.unlink(missing_ok=True)
    return request if isinstance(request, dict) and "to_stage" in request else None


def write_stop_request(pod_dir: Path) -> None:
    (pod_dir / STOP_REQUEST_FILE).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(pod_dir / STOP_REQUEST_FILE, json.dumps({"ts": time.time()}) + "\n")


def take_stop_request(pod_dir: Path, since: float) -> bool:
    """Whether `stop` asked at or after `since` (this process's start); consumed either way."""
    path = pod_dir / STOP_REQUEST_FILE
    request = read_json_state(path)
    path.unlink(missing_ok=True)
    ts = request.get("ts")
    return isinstance(ts, (int, float)) and ts >= since
