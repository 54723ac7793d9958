"""logs/sync_state.json: what the hub sync did last (status shows it). Written only by
sync.py, sync_push.py and retention.py; its own module so retention.py need not import sync.py."""

from __future__ import annotations

from pathlib import Path

from launcher.files import read_json_state, write_json_state
from launcher.paths import SYNC_STATE


def read_sync_state(pod_dir: Path) -> dict:
    return read_json_state(pod_dir / SYNC_STATE)


def update_sync_state(pod_dir: Path, **fields) -> dict:
    state = {**read_sync_state(pod_dir), **fields}
    write_json_state(pod_dir / SYNC_STATE, state)
    return state
