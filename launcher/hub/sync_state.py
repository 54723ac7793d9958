"""logs/sync_state.json: what the hub sync did last (status shows it).

Its own module: the sync policy (sync.py) and the retention step (retention.py) both write
it, and retention.py reading it through sync.py closed an import circle between the two.
"""

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
