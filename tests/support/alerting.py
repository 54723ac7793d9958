"""A pod config with one alert webhook whose URL (in an environment variable, as a user
sets it) points at a WebhookServer, and how to read back what each format delivered."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from launcher.paths import CONFIG_NAME

HOOK_ENV = "FRACTUS_TEST_WEBHOOK_URL"
# A path that stands for the secret part of a real webhook URL (Slack's, Discord's token).
SECRET_PATH = "/hooks/T0SECRET/B0SECRET/xoxSecretToken123"


def configure_alerts(pod: Path, fmt: str, alerts: dict | None = None, **config) -> None:
    """`alerts:` with one webhook of format `fmt` (plus the `alerts` keys) in the pod's
    config (plus the `config` keys)."""
    path = pod / CONFIG_NAME
    data = yaml.safe_load(path.read_text())
    data["alerts"] = {"webhooks": [{"format": fmt, "url_env": HOOK_ENV}], **(alerts or {})}
    data.update(config)
    path.write_text(yaml.safe_dump(data))


def delivered(received, fmt: str) -> list[dict]:
    """The alerts in the messages received, each as {"title", "text", "facts"} (facts only
    from the generic format; the others carry the facts in their text)."""
    out = []
    for message in received:
        if fmt == "generic":
            body = message.json()
            for alert in body.get("alerts", [body]):
                out.append({"title": alert["title"], "facts": alert["facts"],
                            "text": json.dumps(alert)})
            continue
        if fmt == "ntfy":
            assert message.headers["Priority"] in ("default", "high", "urgent")
            title, text = message.headers["Title"], message.text
        else:
            text = message.json()["text" if fmt == "slack" else "content"]
            title = text.splitlines()[0]
        lines = text.splitlines()
        summary = [line[2:] for line in lines[1:] if line.startswith("- [")]
        out += ([{"title": line, "text": text, "facts": None} for line in summary] or
                [{"title": title, "text": text, "facts": None}])
    return out


def files_holding(pod: Path, secret: str) -> list[str]:
    """Every file under the pod whose bytes contain `secret`."""
    needle = secret.encode()
    return [str(p.relative_to(pod)) for p in pod.rglob("*")
            if p.is_file() and needle in p.read_bytes()]
