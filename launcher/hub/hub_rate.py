"""logs/hub_rate.json: whether the hub is rate-limiting this pod (one incident at a time:
opened by the first rate-limited answer, closed by the next answered call, then kept as
`last_incident`) and the commits of the last hour. Written only by the hf:// store, read by
`status`; updates of one process are serialized, the file replaced atomically."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from launcher.files import read_json_state, write_json_state
from launcher.hub.commit_budget import HOUR_S
from launcher.paths import HUB_RATE_STATE
from launcher.pod.events import EventLog

_lock = threading.Lock()


def read_hub_rate(pod_dir: Path) -> dict:
    return read_json_state(pod_dir / HUB_RATE_STATE)


def _update(pod_dir: Path, change) -> dict:
    with _lock:
        state = read_hub_rate(pod_dir)
        change(state)
        write_json_state(pod_dir / HUB_RATE_STATE, state)
        return state


def note_wait(pod_dir: Path, what: str, seconds: float, told: float | None,
              push: str | None = None) -> None:
    """The hub rate-limited `what`; the next try waits `seconds` (`told`: the wait it named).
    `push`: the push's id (each delayed push counted once)."""
    now = time.time()
    opened: list[dict] = []

    def change(state: dict) -> None:
        incident = state.get("limited")
        if not isinstance(incident, dict):
            incident = {"since": now, "waits": 0, "waited_s": 0.0, "pushes_delayed": 0,
                        "last_push": None}
            opened.append(incident)
        incident.update(last_at=now, retry_at=now + seconds, what=what, told_s=told,
                        waits=int(incident.get("waits", 0)) + 1,
                        waited_s=round(float(incident.get("waited_s", 0.0)) + seconds, 3))
        if push is not None and push != incident.get("last_push"):
            incident["pushes_delayed"] = int(incident.get("pushes_delayed", 0)) + 1
            incident["last_push"] = push
        state["limited"] = incident

    _update(pod_dir, change)
    if opened:
        EventLog(pod_dir).emit("hub_rate_limited", what=what, wait_s=round(seconds, 3),
                               told_s=told)


def note_answered(pod_dir: Path) -> None:
    """The hub answered a call again: an open incident ends (recorded, with its cost)."""
    now = time.time()
    ended: list[dict] = []

    def change(state: dict) -> None:
        incident = state.get("limited")
        if isinstance(incident, dict):
            incident = {**incident, "ended_at": now}
            incident.pop("last_push", None)
            state["last_incident"], state["limited"] = incident, None
            ended.append(incident)

    if isinstance(read_hub_rate(pod_dir).get("limited"), dict):
        _update(pod_dir, change)
    if ended:
        incident = ended[0]
        EventLog(pod_dir).emit("hub_rate_limit_ended",
                               seconds=round(now - float(incident["since"]), 2),
                               waits=incident.get("waits"), waited_s=incident.get("waited_s"),
                               pushes_delayed=incident.get("pushes_delayed"))


def note_commit(pod_dir: Path, revision: str, repo: str) -> None:
    """Count a commit on `repo` (hf:// URL; the budget is per repo, a dataset's is not the pod's)."""
    now = time.time()

    def change(state: dict) -> None:
        state["commits"] = [*_recent(state.get("commits"), now), [now, repo]]
        state["last_commit"] = revision

    _update(pod_dir, change)


def _recent(stamps, now: float, repo: str | None = None) -> list[list]:
    if not isinstance(stamps, list):
        return []
    return [s for s in stamps if isinstance(s, list) and len(s) == 2
            and isinstance(s[0], (int, float)) and now - HOUR_S < s[0] <= now + 60
            and repo in (None, s[1])]


def commits_last_hour(state: dict, now: float | None = None, repo: str | None = None) -> int:
    """Commits landed in the hour before `now`, on `repo` (None: on any)."""
    return len(_recent(state.get("commits"), time.time() if now is None else now, repo))


def rate_report(pod_dir: Path, now: float | None = None,
                repo: str | None = None) -> dict | None:
    """What `status` shows (commits counted on `repo`); None if never committed nor limited."""
    state = read_hub_rate(pod_dir)
    if not state:
        return None
    incident = state.get("limited")
    return {"limited": {k: v for k, v in incident.items() if k != "last_push"}
            if isinstance(incident, dict) else None,
            "last_incident": state.get("last_incident"),
            "commits_last_hour": commits_last_hour(state, now, repo)}


def rate_line(report: dict, budget: int | None = None) -> str:
    """`status`'s line: commits of the last hour, and the open incident (local times)."""
    commits = f"{report['commits_last_hour']} commits in the last hour" + \
        (f" (budget {budget}/hour)" if budget else "")
    incident = report.get("limited")
    if not incident:
        return f"hub: {commits}"
    delayed, waits = int(incident.get("pushes_delayed", 0)), int(incident.get("waits", 0))
    return (f"hub: RATE-LIMITED since {_clock(incident.get('since'))} "
            f"({waits} wait{'' if waits == 1 else 's'}, {delayed} "
            f"push{'' if delayed == 1 else 'es'} delayed; next try "
            f"{_clock(incident.get('retry_at'))}); {commits}")


def _clock(stamp) -> str:
    try:
        return time.strftime("%H:%M:%S", time.localtime(float(stamp)))
    except (TypeError, ValueError, OverflowError):
        return "?"
