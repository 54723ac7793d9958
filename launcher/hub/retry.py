"""Bounded retries with exponential backoff for calls to a remote hub.

Only transient failures are retried: HTTP 5xx, 408 and 429 answers, timeouts and broken
connections. Anything else (404, 401, a refused commit, a bad argument) is a real answer and
is raised at once. Log lines name the operation and the kind of failure, never request
headers, so a token cannot leak through them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

import httpx2
from huggingface_hub.errors import HfHubHTTPError

from launcher.paths import HUB_LOG

log = logging.getLogger(__name__)

T = TypeVar("T")

# Status codes a later attempt can cure: server errors, request timeout, rate limiting.
TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})


@dataclass(frozen=True)
class RetryPolicy:
    """How hard to insist before giving up on one remote operation."""

    attempts: int = 5  # total tries, first one included
    base_delay_s: float = 1.0  # wait before the second try; doubles after each failure
    max_delay_s: float = 30.0

    def delay(self, failures: int) -> float:
        """Seconds to wait after `failures` consecutive failures (1-based)."""
        return min(self.max_delay_s, self.base_delay_s * (2 ** (failures - 1)))


def http_status(exc: BaseException) -> int | None:
    """Status code of an HTTP error raised by huggingface_hub, else None."""
    if isinstance(exc, HfHubHTTPError) and exc.response is not None:
        return exc.response.status_code
    return None


def is_transient(exc: BaseException) -> bool:
    """True if `exc`, or an error it wraps, is worth another try.

    The client wraps some transport failures (an LFS upload's RuntimeError, a failed forced
    download's ValueError) around the real cause, so the cause chain is walked too.
    """
    seen = 0
    while exc is not None and seen < 8:
        if _is_transient_one(exc):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def _is_transient_one(exc: BaseException) -> bool:
    status = http_status(exc)
    if status is not None:
        return status in TRANSIENT_STATUS
    # TimeoutException, NetworkError (connect/read/write errors) and a peer that hung up
    # mid-message (RemoteProtocolError) are all worth another try.
    if isinstance(exc, (httpx2.TimeoutException, httpx2.NetworkError, httpx2.RemoteProtocolError)):
        return True
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    # huggingface_hub raises a bare OSError when a download ends short of its announced size.
    return type(exc) is OSError and "Consistency check failed" in str(exc)


def describe(exc: BaseException) -> str:
    """Short one-line description of a failure, safe for logs (no headers, no bodies)."""
    status = http_status(exc)
    if status is not None:
        return f"HTTP {status}"
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first_line[:200]}" if first_line else type(exc).__name__


def with_retries(
    fn: Callable[[], T],
    what: str,
    policy: RetryPolicy,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """Call `fn` until it succeeds, fails for good, or `policy.attempts` are spent."""
    failures = 0
    while True:
        try:
            return fn()
        except Exception as exc:
            if not is_transient(exc):
                raise
            failures += 1
            if failures >= policy.attempts:
                # The one line a person sees per failed operation (stderr); each retry
                # before it is in logs/hub.log (INFO, launcher/cli/options.py).
                log.warning("hub: %s failed (%s); gave up after %d attempts (each in "
                            "%s)", what, describe(exc), failures, HUB_LOG)
                raise
            wait = policy.delay(failures)
            log.info(
                "hub: %s failed (%s); retry %d/%d in %.1fs",
                what, describe(exc), failures, policy.attempts - 1, wait,
            )
            sleep(wait)
