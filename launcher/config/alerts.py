"""`alerts:` of the pod config (docs/LAUNCHER.md, Alerts while you are away).

A webhook's URL is a secret (the config is pushed and shown), so the file names only the
launcher's environment variable that holds it; no child gets that variable.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from launcher.errors import UserError, check_number, optional_section, refuse_unknown_keys

FORMATS = ("generic", "ntfy", "slack", "discord")
SEVERITIES = ("info", "warning", "critical")          # lowest first
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class WebhookSetting:
    format: str
    url_env: str                 # the launcher's environment variable that holds the URL

    KEYS = ("format", "url_env")

    @property
    def name(self) -> str:
        """How the webhook is named in events and output: never by its URL."""
        return f"{self.format} (${self.url_env})"


@dataclass(frozen=True)
class AlertSettings:
    webhooks: tuple[WebhookSetting, ...] = ()
    min_severity: str = "warning"
    # A hub push failing at this many intervals in a row is an incident (one usually passes
    # at the next interval).
    hub_failures: int = 3
    # The same incident (its dedupe key) is said again only after this long.
    repeat_after_s: float = 3600.0
    # At most this many messages per webhook per minute; the rest go into a summary.
    per_minute: int = 6

    KEYS = ("webhooks", "min_severity", "hub_failures", "repeat_after_s", "per_minute")
    RANGES = {"hub_failures": (1, 1000), "repeat_after_s": (0, 7 * 86400),
              "per_minute": (1, 600)}

    def wants(self, severity: str) -> bool:
        return SEVERITIES.index(severity) >= SEVERITIES.index(self.min_severity)

    @classmethod
    def parse(cls, data: dict | None, source: str = "alerts") -> "AlertSettings | None":
        """None when the config has no `alerts:` (nothing is sent)."""
        data = optional_section(data, cls.KEYS, source, "(webhooks:, min_severity:)")
        if data is None:
            return None
        hooks = data.get("webhooks")
        if not isinstance(hooks, list) or not hooks:
            raise UserError(f"{source}.webhooks must be a list of {{format: "
                            f"{'|'.join(FORMATS)}, url_env: NAME}}, got {hooks!r}")
        severity = data.get("min_severity", cls.min_severity)
        if severity not in SEVERITIES:
            raise UserError(f"{source}.min_severity must be one of {', '.join(SEVERITIES)}, "
                            f"got {severity!r}")
        numbers = {key: check_number(data[key], f"{source}.{key}", low, high,
                                     "a number" if key == "repeat_after_s" else "an integer")
                   for key, (low, high) in cls.RANGES.items() if key in data}
        return cls(tuple(_webhook(h, f"{source}.webhooks[{i}]") for i, h in enumerate(hooks)),
                   severity, **numbers)


def check_alerts(settings: "AlertSettings | None", pass_env: list, source: str) -> None:
    """No webhook's variable in `pass_env:` (the workers would get the secret)."""
    for hook in settings.webhooks if settings else ():
        if hook.url_env in pass_env:
            raise UserError(f"{source}: pass_env: {hook.url_env} holds a webhook URL of "
                            f"alerts: (a secret only the launcher uses); remove it from "
                            f"pass_env")


def _webhook(data, source: str) -> WebhookSetting:
    if not isinstance(data, dict):
        raise UserError(f"{source} must be a mapping {{format: ..., url_env: ...}}, got "
                        f"{data!r}")
    refuse_unknown_keys(data, WebhookSetting.KEYS, source)
    fmt, env = data.get("format"), data.get("url_env")
    if fmt not in FORMATS:
        raise UserError(f"{source}.format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if not isinstance(env, str) or not _ENV_NAME.fullmatch(env):
        raise UserError(f"{source}.url_env must name the environment variable that holds "
                        f"the webhook's URL (e.g. NTFY_URL), got {env!r}; the URL itself "
                        f"never goes in the file")
    return WebhookSetting(fmt, env)
