"""A hub call's retries (`with_retries`, on the one loop of retry_loop.py): never earlier than
the hub asked, never for ever. Only transient failures are retried (5xx, 408, 429, timeouts,
broken connections); any other answer is raised at once. Log lines never carry request
headers, so no token leaks. Rate-limit waits (`Retry-After`, or a `RateLimit` reset when none
remains) do not spend `attempts`; past `rate_limit_wait_s` in all, RateLimited says when to
try again. docs/LAUNCHER.md "Hub", "Rate limits and the commit budget"."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Callable, TypeVar

import httpx2
from huggingface_hub.errors import HfHubHTTPError
from huggingface_hub.utils import parse_ratelimit_headers

from launcher.paths import HUB_LOG

from .integrity import HubError
from .retry_loop import retrying

log = logging.getLogger(__name__)

T = TypeVar("T")

# Status codes a later attempt can cure: server errors, request timeout, rate limiting.
TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
RATE_LIMITED_STATUS = 429
RATE_LIMIT_FLOOR_S = 5.0      # a 429 that names no wait: the first wait, doubling from here
RATE_LIMIT_WAIT_S = 600.0     # rate-limit waits of one operation, in all, before RateLimited
MAX_TOLD_WAIT_S = 86400.0     # a Retry-After beyond a day is read as a day


class RateLimited(HubError):
    """Rate-limited past the bounded wait: try again no earlier than `retry_at` (time.time())."""

    def __init__(self, message: str, retry_at: float):
        super().__init__(message, status=RATE_LIMITED_STATUS)
        self.retry_at = retry_at


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 5  # total tries of failures other than rate limiting, first one included
    base_delay_s: float = 1.0  # wait before the second try; doubles after each failure
    max_delay_s: float = 30.0
    rate_limit_wait_s: float = RATE_LIMIT_WAIT_S   # waits on rate-limited answers, in all

    def delay(self, failures: int) -> float:
        """Seconds to wait after `failures` consecutive failures (1-based)."""
        return min(self.max_delay_s, self.base_delay_s * (2 ** (failures - 1)))

    def rate_limit_delay(self, told: float | None, waits: int) -> float:
        """Seconds before the try after the `waits`-th (1-based) rate-limited answer: `told`
        as is the first time, after that never below the doubling backoff (a hub answering
        `Retry-After: 0` again and again is not hammered)."""
        cap = max(self.max_delay_s, RATE_LIMIT_FLOOR_S)
        if told is None:
            return min(cap, RATE_LIMIT_FLOOR_S * (2 ** (waits - 1)))
        return max(told, 0.0 if waits == 1 else min(cap, RATE_LIMIT_FLOOR_S * (2 ** (waits - 2))))


def told_wait(exc: BaseException, now: float | None = None) -> float | None:
    """Seconds the hub asked to wait: `Retry-After` (seconds or HTTP date), else the reset
    of an exhausted `RateLimit` header; None when it names none."""
    response = exc.response if isinstance(exc, HfHubHTTPError) else None
    if response is None:
        return None
    headers = response.headers
    value = (headers.get("Retry-After") or "").strip()
    if value:
        if value.isdigit():
            return min(float(value), MAX_TOLD_WAIT_S)
        try:
            when = parsedate_to_datetime(value).timestamp()
        except (TypeError, ValueError, IndexError, OverflowError):
            when = None
        if when is not None:
            return min(max(0.0, when - (time.time() if now is None else now)), MAX_TOLD_WAIT_S)
    info = parse_ratelimit_headers(headers)
    if info is not None and info.remaining == 0:
        return min(float(info.reset_in_seconds), MAX_TOLD_WAIT_S)
    return None


def rate_limited_wait(exc: BaseException) -> tuple[bool, float | None]:
    """(rate-limited?, named wait): a 429, or any answer naming a wait (503 + Retry-After)."""
    status = http_status(exc)
    if status is None:
        return False, None
    told = told_wait(exc)
    return status == RATE_LIMITED_STATUS or told is not None, told


def http_status(exc: BaseException) -> int | None:
    """Status code of an HTTP error raised by huggingface_hub, else None."""
    if isinstance(exc, HfHubHTTPError) and exc.response is not None:
        return exc.response.status_code
    return None


def is_transient(exc: BaseException) -> bool:
    """True if `exc` or its cause chain is worth another try (the client wraps transport
    failures in RuntimeError/ValueError)."""
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
    sleep: Callable[[float], None] | None = None,
    on_wait: Callable[[str, float, float | None], None] | None = None,
) -> T:
    """Call `fn` until success, a lasting failure, `policy.attempts` spent, or RateLimited.
    `on_wait(what, seconds, told)` hears of each rate-limit wait before it is slept."""
    failures = waits = 0
    waited = 0.0

    def after_failure(exc: Exception) -> float:
        nonlocal failures, waits, waited
        if not is_transient(exc):
            raise exc
        limited, told = rate_limited_wait(exc)
        if limited:
            waits += 1
            wait = policy.rate_limit_delay(told, waits)
            said = "" if told is None else f", the hub asked for {told:g}s"
            if waited + wait > policy.rate_limit_wait_s:
                log.warning("hub: %s rate-limited (%s%s); gave up waiting after %.0fs "
                            "(each wait in %s)", what, describe(exc), said, waited, HUB_LOG)
                raise RateLimited(f"{what}: the hub is rate-limiting (HTTP "
                                  f"{http_status(exc)}{said}); waited {waited:.0f}s, "
                                  f"next try in {wait:.0f}s", time.time() + wait) from None
            log.info("hub: %s rate-limited (%s%s); retry in %.1fs (waited %.0fs of %.0fs)",
                     what, describe(exc), said, wait, waited, policy.rate_limit_wait_s)
            if on_wait is not None:
                on_wait(what, wait, told)
            waited += wait
            return wait
        failures += 1
        if failures >= policy.attempts:
            # The one line a person sees per failed operation (stderr); each retry
            # before it is in logs/hub.log (INFO, launcher/cli/options.py).
            log.warning("hub: %s failed (%s); gave up after %d attempts (each in "
                        "%s)", what, describe(exc), failures, HUB_LOG)
            raise exc
        wait = policy.delay(failures)
        log.info("hub: %s failed (%s); retry %d/%d in %.1fs",
                 what, describe(exc), failures, policy.attempts - 1, wait)
        return wait
    return retrying(fn, after_failure, sleep)
