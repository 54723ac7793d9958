"""Is the Ray cluster there? Asked before `launch` writes anything to the pod.

Invariant: a refusal leaves the pod byte for byte as it was. `ray.init(address=...)` where
nothing listens retries for ever, so a plain TCP connection to the GCS address comes first
(no Ray import: fork-safe). Owner: `refuse_unreachable`.
"""

from __future__ import annotations

import socket

from launcher.config.ray_settings import RaySettings
from launcher.errors import UserError

REACH_TIMEOUT_S = 10.0     # a loaded head answers a TCP handshake well within this


def gcs_endpoint(address: str) -> tuple[str, int] | None:
    """(host, port) of a `host:port` address; None for what Ray resolves itself (`auto`,
    a `ray://` client address, anything without a port)."""
    if address == "auto" or "://" in address:
        return None
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def refuse_unreachable(settings: RaySettings, timeout_s: float = REACH_TIMEOUT_S) -> None:
    endpoint = gcs_endpoint(settings.address)
    if endpoint is None:
        return
    try:
        socket.create_connection(endpoint, timeout=timeout_s).close()
    except OSError as exc:
        raise UserError(unreachable(settings.address, exc)) from None


def unreachable(address: str, exc: BaseException) -> str:
    """The one line of a cluster that cannot be reached (here, or by Ray itself)."""
    return (f"ray: cannot reach the cluster at {address} "
            f"({' '.join(str(exc).split())[:200] or type(exc).__name__}); is `ray start` "
            f"running there? (give its address with --ray HOST:PORT or ray: {{address: ...}})")
