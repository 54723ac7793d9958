"""One message (one alert, or a summary of several) in a webhook kind's format: ntfy,
Slack, Discord or generic JSON."""

from __future__ import annotations

import json
import socket
from pathlib import Path

from launcher.alerts.rules import Alert, worst

NTFY_PRIORITY = {"info": "default", "warning": "high", "critical": "urgent"}
NTFY_TAG = {"info": "information_source", "warning": "warning", "critical": "rotating_light"}
DISCORD_LIMIT = 2000          # characters of a Discord message's content
SLACK_LIMIT = 3000            # keep a Slack message readable on a phone


def pod_label(pod_dir: Path) -> str:
    """Which pod a message is from: the machine and the pod directory's name."""
    return f"{socket.gethostname()}:{pod_dir.name}"


def title_of(alerts: list[Alert], pod: str) -> str:
    if len(alerts) == 1:
        return f"[{alerts[0].severity}] {pod}: {alerts[0].title}"
    return f"[{worst(alerts)}] {pod}: {len(alerts)} alerts"


def text_of(alerts: list[Alert], pod: str, dropped: int = 0) -> str:
    """The title, the facts (or one line per alert of a summary), and how many were dropped."""
    lines = [title_of(alerts, pod)]
    if len(alerts) == 1:
        facts = alerts[0].facts
        lines.append(", ".join(f"{k}: {v}" for k, v in facts.items()))
    else:
        lines += [f"- [{a.severity}] {a.title}" for a in alerts]
    if dropped:
        lines.append(f"({dropped} more alert(s) dropped: the webhook was not keeping up)")
    return "\n".join(line for line in lines if line)


def _generic_one(alert: Alert, pod: str) -> dict:
    return {"event": alert.event, "severity": alert.severity, "pod": pod,
            "title": alert.title, "key": alert.key, "ts": alert.ts, "facts": alert.facts}


def render(fmt: str, alerts: list[Alert], pod: str,
           dropped: int = 0) -> tuple[bytes, dict[str, str]]:
    """(body, headers) for a webhook of format `fmt`; `dropped`: alerts a full queue refused."""
    if fmt == "ntfy":
        # HTTP headers are latin-1: anything else in a reason becomes "?".
        title = title_of(alerts, pod).encode("latin-1", "replace").decode("latin-1")
        tags = ",".join([NTFY_TAG[worst(alerts)]] + sorted({a.event for a in alerts}))
        return text_of(alerts, pod, dropped).encode(), {
            "Title": title, "Priority": NTFY_PRIORITY[worst(alerts)], "Tags": tags,
            "Content-Type": "text/plain; charset=utf-8"}
    if fmt == "slack":
        payload = {"text": text_of(alerts, pod, dropped)[:SLACK_LIMIT]}
    elif fmt == "discord":
        payload = {"content": text_of(alerts, pod, dropped)[:DISCORD_LIMIT]}
    elif len(alerts) == 1:
        payload = _generic_one(alerts[0], pod)
    else:
        payload = {"event": "summary", "severity": worst(alerts), "pod": pod,
                   "title": title_of(alerts, pod),
                   "alerts": [_generic_one(a, pod) for a in alerts]}
    if dropped and fmt == "generic":
        payload["dropped"] = dropped
    return json.dumps(payload, default=str).encode(), {"Content-Type": "application/json"}
