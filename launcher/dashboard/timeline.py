"""What happened when, from logs/events.jsonl: markers (restarts, rollbacks, stage
switches, canary and probe verdicts, hub pushes, merge rounds) and the stage windows shaded behind the
curves. Shared by the dashboard and the plot."""

from __future__ import annotations

from pathlib import Path

from launcher.pod.events import read_events

# event -> marker kind (the page and the plot colour by kind)
MARKER_KINDS = {
    "worker_crash": "restart", "hang": "restart",
    "rollback": "rollback", "check_failed": "rollback",
    "stage_change": "stage",
    "canary": "canary", "canary_skipped": "canary",
    "probe": "probe", "final_verdicts": "verdicts",
    "sync_pushed": "hub_push",
    "merge_round": "merge",      # "merge_refused" when its verdict is not "adopted"
}
MARKER_COLORS = {"restart": "#ff7f0e", "rollback": "#d62728", "stage": "#7f7f7f",
                 "canary": "#9467bd", "probe": "#17becf", "verdicts": "#bcbd22",
                 "hub_push": "#2ca02c", "merge": "#1a237e", "merge_refused": "#e91e63"}


def _number(value, spec: str) -> str:
    """A float as people read it (AR=1078.0662, not 1078.066162109375)."""
    return format(value, spec) if isinstance(value, float) else str(value)


def _label(event: dict) -> str:
    name = event["event"]
    gpu = f"GPU {event['gpu']} " if event.get("gpu") is not None else ""
    if name == "rollback":
        return f"{gpu}rollback stage {event.get('from_stage')} -> {event.get('to_stage')}"
    if name == "check_failed":
        return f"{gpu}check failed: {event.get('reason') or event.get('checks') or ''}"
    if name == "stage_change":   # from_stage: a launch's is the list of stages it found
        was = event.get("from_stage")
        was = "/".join(map(str, was)) if isinstance(was, list) else was
        return f"stage {was} -> {event.get('to_stage')}"
    if name in ("canary", "canary_skipped"):
        verdict = event.get("status") or "skipped"
        return (f"canary {event.get('from_stage')} -> {event.get('to_stage')}: {verdict}")
    if name == "probe":
        return f"{gpu}probe {event.get('status')} AR={_number(event.get('ar'), '.4f')}"
    if name == "final_verdicts":          # the checks' verdicts at a clean end, not a probe
        verdicts = event.get("verdicts") if isinstance(event.get("verdicts"), dict) else {}
        return "final verdicts: " + (", ".join(
            f"GPU {g} {v.get('verdict') if isinstance(v, dict) else v}"
            for g, v in sorted(verdicts.items(), key=lambda kv: str(kv[0]))) or "none")
    if name == "sync_pushed":
        return f"hub push {str(event.get('revision') or '')[:12]}"
    if name == "hang":
        return f"{gpu}hang: restarted"
    if name == "merge_round":
        return _merge_label(event)
    return f"{gpu}crash: {event.get('reason', '')}"


def _merge_label(event: dict) -> str:
    """`round 3 adopted: 3 GPUs (gpu2 left out), 41 s` or `round 3 refused: <reason>`."""
    number = event.get("round")
    if event.get("verdict") != "adopted":
        return f"round {number} refused: {event.get('reason') or ''}"
    quorum = event.get("quorum") if isinstance(event.get("quorum"), list) else []
    left = event.get("left_out") if isinstance(event.get("left_out"), list) else []
    seconds = event.get("seconds")
    return (f"round {number} adopted: {len(quorum)} GPU{'' if len(quorum) == 1 else 's'}"
            + (" (" + ", ".join(f"gpu{g}" for g in left) + " left out)" if left else "")
            + (f", {seconds:.0f} s" if isinstance(seconds, (int, float))
               and not isinstance(seconds, bool) else ""))


def _kind(event: dict) -> str:
    kind = MARKER_KINDS[event["event"]]
    if kind == "merge" and event.get("verdict") != "adopted":
        return "merge_refused"
    return kind


def markers(events: list[dict]) -> list[dict]:
    """One marker per notable event: ts, kind, gpu (None: pod-wide), label."""
    return [{"ts": e.get("ts"), "kind": _kind(e), "gpu": e.get("gpu"),
             "label": _label(e)[:200]}
            for e in events if e.get("event") in MARKER_KINDS and e.get("ts") is not None]


def stage_windows(events: list[dict], until: float | None) -> list[dict]:
    """Spans of one stage, `launch`/`stage_change` to the next (the last up to `until`)."""
    starts = []
    for e in events:
        stage = e.get("stage") if e.get("event") == "launch" else (
            e.get("to_stage") if e.get("event") == "stage_change" else None)
        if isinstance(stage, int) and e.get("ts") is not None:
            if starts and starts[-1][1] == stage:
                continue
            starts.append((e["ts"], stage))
    windows = []
    for i, (ts, stage) in enumerate(starts):
        end = starts[i + 1][0] if i + 1 < len(starts) else max(until or ts, ts)
        windows.append({"start": ts, "end": end, "stage": stage})
    return windows


def run_starts(events: list[dict]) -> list[float]:
    return [e["ts"] for e in events if e.get("event") == "launch" and e.get("ts") is not None]


def read_timeline(pod_dir: Path, until: float | None, axis=None) -> dict:
    """Markers, stage windows and run starts, each with its x on `axis` when given."""
    events = read_events(pod_dir)
    timeline = {"markers": markers(events), "stages": stage_windows(events, until),
                "runs": [{"ts": ts} for ts in run_starts(events)]}
    if axis is not None:
        for item in timeline["markers"] + timeline["runs"]:
            item["x"] = float(axis.at(item["ts"]))
        for window in timeline["stages"]:
            window["x0"], window["x1"] = (float(v) for v in axis.at([window["start"],
                                                                     window["end"]]))
    return timeline
