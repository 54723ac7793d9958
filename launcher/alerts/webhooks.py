"""A webhook's URL, read from the launcher's environment (it is a secret: the config names
only the variable), and the one HTTP POST that delivers a message to it."""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Mapping
from urllib.parse import urlsplit

from launcher.config.alerts import AlertSettings, WebhookSetting
from launcher.errors import UserError
from launcher.hub.redact import register_secret


@dataclass(frozen=True, repr=False)
class Webhook:
    setting: WebhookSetting
    url: str

    @property
    def name(self) -> str:
        return self.setting.name

    @property
    def format(self) -> str:
        return self.setting.format

    def __repr__(self) -> str:          # never the URL, whoever prints the object
        return f"Webhook({self.name})"


def resolve_webhooks(settings: AlertSettings,
                     environ: Mapping[str, str] | None = None) -> list[Webhook]:
    """Each configured webhook with its URL from the environment; UserError if unset or not
    http(s) (the URL itself never shown)."""
    environ = os.environ if environ is None else environ
    hooks = []
    for setting in settings.webhooks:
        url = environ.get(setting.url_env, "").strip()
        if not url:
            raise UserError(f"alerts: webhook {setting.name}: ${setting.url_env} is not set "
                            f"in the launcher's environment; export the webhook's URL in it "
                            f"or remove the webhook from alerts:")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            shown = f"a {parts.scheme!r} URL" if parts.scheme else "no URL"
            raise UserError(f"alerts: webhook {setting.name}: ${setting.url_env} must hold "
                            f"an http:// or https:// URL, it holds {shown}; fix the variable")
        register_secret(url)
        hooks.append(Webhook(setting, url))
    return hooks


class DeliveryError(Exception):
    """One failed POST; `retry` is False when trying again cannot help (a 4xx answer)."""

    def __init__(self, message: str, retry: bool = True):
        super().__init__(message)
        self.retry = retry


def post(hook: Webhook, body: bytes, headers: dict[str, str], timeout_s: float) -> int:
    """POST `body`; the HTTP status, or DeliveryError (never quoting the URL)."""
    request = urllib.request.Request(hook.url, data=body, method="POST",
                                     headers={"User-Agent": "fractus-pod", **headers})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            answer.read(65536)
            return answer.status
    except urllib.error.HTTPError as exc:
        retry = exc.code >= 500 or exc.code == 429
        raise DeliveryError(f"HTTP {exc.code} {exc.reason}", retry) from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        text = f"{type(reason).__name__}: {reason}".replace(hook.url, "<webhook URL>")
        raise DeliveryError(" ".join(text.split())[:200]) from None


def configured_webhooks(config) -> tuple[AlertSettings, list[Webhook]] | None:
    """The pod config's alerts with their URLs read; None without `alerts:`."""
    settings = config.alert_settings()
    if settings is None:
        return None
    return settings, resolve_webhooks(settings)
