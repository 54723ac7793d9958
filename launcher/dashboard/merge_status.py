"""What `status` and the dashboard say of merge rounds: the last round's verdict, the next
round's token per GPU, a round in progress. Read only, from merge/rounds.json (the ledger,
owner launcher/supervise/merge_rounds.py) and the workers' `merge_wait` records; every
field is range-checked, and a malformed ledger is one line of its own: the rest of `status`
stands. No ledger: no line (a pod without rounds shows nothing of them).
"""

from __future__ import annotations

import json
from pathlib import Path

from launcher.dashboard.status_checkpoints import last_record
from launcher.paths import metrics_path
from launcher.pod.rounds_ledger import MAX_TOKEN, LedgerError, read_ledger

WORKER_MERGE_EVENTS = ("merge_wait", "merge_adopted", "merge_skipped")


def read_rounds_ledger(pod_dir: Path) -> dict | None:
    """{origins: {stage: {gpu: token}}, rounds: [what status shows of each]} from the ledger
    (checked whole by launcher/pod/rounds_ledger.py); None: no ledger. Raises LedgerError."""
    ledger = read_ledger(pod_dir)
    if ledger is None:
        return None
    origins = {int(stage): {int(g): t for g, t in per_gpu.items()}
               for stage, per_gpu in ledger["origins"].items()}
    rounds = []
    for e in ledger["rounds"]:
        reason = e.get("reason")
        rounds.append({"round": e["round"], "stage": e["stage"], "boundary": e.get("boundary"),
                       "state": e["state"], "gpus": sorted(int(g) for g in e["gpus"]),
                       "left_out": sorted(e.get("left_out", [])),
                       "reason": " ".join(reason.split())[:300]
                       if isinstance(reason, str) else None})
    return {"origins": origins, "rounds": rounds}


def _setting(config, name: str):
    """`merge_rounds:`'s field, whether the config holds the section parsed or as a dict
    (None: no such section)."""
    section = getattr(config, "merge_rounds", None)
    if isinstance(section, dict):
        return section.get(name)
    return getattr(section, name, None)


def _next_tokens(ledger: dict, config, stage: int | None) -> tuple[dict | None, str | None]:
    """({gpu: token} of the next periodic round, None) or (None, "stage_end") or (None, None)."""
    every = _setting(config, "every_tokens")
    if isinstance(every, bool) or not isinstance(every, int) or not 0 < every <= MAX_TOKEN:
        return None, ("stage_end" if _setting(config, "at_stage_end") is True else None)
    origins = ledger["origins"].get(stage) if stage is not None else None
    if not origins:
        return None, None
    done = [r["boundary"] for r in ledger["rounds"]
            if r["stage"] == stage and r["boundary"] is not None]
    boundary = max(done) + 1 if done else 1       # boundary k: origin + k * every_tokens
    return {g: t + boundary * every for g, t in sorted(origins.items())}, None


def _waiting(pod_dir: Path, gpus: list[int], since: float) -> list[int]:
    """The GPUs whose newest round record (of this launch) is a `merge_wait`: paused at a
    boundary, waiting for the verdict."""
    waiting = []
    for gpu in gpus:
        record = last_record(pod_dir / metrics_path(gpu),
                             lambda r: r.get("event") in WORKER_MERGE_EVENTS)
        ts = (record or {}).get("ts")
        if record and record["event"] == "merge_wait" and isinstance(ts, (int, float)) \
                and ts >= since:
            waiting.append(gpu)
    return waiting


def rounds_report(pod_dir: Path, config, stage: int | None, gpus: list[int],
                  running: dict | None) -> dict | None:
    """`status`'s `merge_rounds`: last (the newest decided round), in_progress, next_tokens,
    next_at, error and the `line` shown; None without a ledger. `running`: the running
    launcher's view of the pod (None: none runs, so no GPU waits in a round now)."""
    try:
        ledger = read_rounds_ledger(pod_dir)
    except LedgerError as exc:
        report = {"error": str(exc), "last": None, "in_progress": None,
                  "next_tokens": None, "next_at": None}
        return {**report, "line": rounds_line(report)}
    if ledger is None:
        return None
    rounds = ledger["rounds"]
    decided = [r for r in rounds if r["state"] != "merging"]
    merging = rounds[-1] if rounds and rounds[-1]["state"] == "merging" else None
    in_progress = None
    started_at = (running or {}).get("started_at")
    if isinstance(started_at, (int, float)):
        waiting = _waiting(pod_dir, gpus, started_at)
        if merging or waiting:
            number = merging["round"] if merging else (rounds[-1]["round"] + 1 if rounds else 1)
            in_progress = {"round": number, "waiting": waiting, "gpus": len(gpus)}
    elif merging:
        in_progress = {"round": merging["round"], "waiting": None, "gpus": len(gpus)}
    next_tokens, next_at = _next_tokens(ledger, config, stage)
    report = {"error": None, "last": decided[-1] if decided else None,
              "in_progress": in_progress, "next_tokens": next_tokens, "next_at": next_at}
    return {**report, "line": rounds_line(report)}


def _gpu_list(gpus: list[int]) -> str:
    return ", ".join(f"gpu{g}" for g in gpus)


def rounds_line(report: dict) -> str:
    """One line: `merge rounds: round 3 adopted (3/4 GPUs, gpu2 left out); next at gpu0@...`."""
    if report.get("error"):
        return f"merge rounds: {report['error']}"
    parts = []
    last = report.get("last")
    if last is None:
        parts.append("no round yet")
    elif last["state"] == "adopted":
        n = len(last["gpus"]) + len(last["left_out"])
        parts.append(f"round {last['round']} adopted ({len(last['gpus'])}/{n} GPUs"
                     + (f", {_gpu_list(last['left_out'])} left out" if last["left_out"] else "")
                     + ")")
    else:
        parts.append(f"round {last['round']} refused: {last.get('reason') or 'no reason given'}")
    going = report.get("in_progress")
    if going and going["waiting"] is None:
        parts.append(f"round {going['round']} merging, not decided (no launcher running: "
                     f"the next launch runs it again)")
    elif going:
        parts.append(f"round {going['round']} merging: {len(going['waiting'])}/{going['gpus']} "
                     f"GPUs waiting")
    if report.get("next_tokens"):
        parts.append("next at " + " ".join(f"gpu{g}@{t:,}"
                                           for g, t in report["next_tokens"].items()))
    elif report.get("next_at") == "stage_end":
        parts.append("next at the stage's end")
    return "merge rounds: " + "; ".join(parts)
