"""Secrets out of everything the pod shows: the hub token (HF_TOKEN or the client's login
cache), the alert webhooks' URLs (registered by launcher/alerts/webhooks.py when it reads
them) and anything that looks like a token never reach events, status, logs or the
dashboard."""

from __future__ import annotations

import os
import re
from launcher.hub.integrity import HubError

_TOKEN_LIKE = re.compile(r"hf_[A-Za-z0-9_]{6,}")
# Secrets this process read besides the hub token: the alert webhooks' URLs.
_REGISTERED: set[str] = set()


# ---- secrets ----------------------------------------------------------------------------
def register_secret(value: str) -> None:
    """`value` is scrubbed from now on (a webhook URL the launcher read from its env)."""
    if value:
        _REGISTERED.add(value)


def scrub(text: str) -> str:
    """`text` without the hub token, the registered secrets, or anything token-like."""
    secrets = {os.environ.get("HF_TOKEN") or "", *_REGISTERED}
    try:
        from huggingface_hub import get_token   # its token lookup (~75 ms) kept off status's path
        secrets.add(get_token() or "")
    except Exception:
        pass
    for secret in sorted(filter(None, secrets), key=len, reverse=True):
        text = text.replace(secret, "<redacted>")
    return _TOKEN_LIKE.sub("hf_<redacted>", text)


def describe_error(exc: BaseException) -> str:
    text = str(exc) if isinstance(exc, HubError) else f"{type(exc).__name__}: {exc}"
    return scrub(" ".join(text.split()))[:500]
