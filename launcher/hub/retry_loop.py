"""The one retry loop (`retrying`) and its plain policy (`attempts`): hub calls
(launcher/hub/retry.py's `with_retries` adds the hub's rate limits on top), downloads whose
bytes differ, a writer's push conflicts, webhook posts. No HTTP client is imported here, so
the lease (read by `status`) and the alert senders use it without loading one."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


def retrying(fn: Callable[[], T], after_failure: Callable[[Exception], float],
             sleep: Callable[[float], None] | None = None) -> T:
    """Call `fn` until it returns; after each failure `after_failure(exc)` raises or returns
    the seconds to wait."""
    sleep = sleep or _sleep
    while True:
        try:
            return fn()
        except Exception as exc:
            sleep(after_failure(exc))


def attempts(tries: int, retry_if: Callable[[Exception], bool],
             backoff: Callable[[int], float] = lambda failures: 0.0,
             on_retry: Callable[[Exception, int], None] | None = None
             ) -> Callable[[Exception], float]:
    """`after_failure` for `retrying`: `tries` in all; a failure `retry_if` refuses, or the
    last, is raised; else `on_retry(exc, failures)`, then `backoff(failures)` seconds."""
    failures = 0

    def after_failure(exc: Exception) -> float:
        nonlocal failures
        failures += 1
        if failures >= tries or not retry_if(exc):
            raise exc
        if on_retry is not None:
            on_retry(exc, failures)
        return backoff(failures)
    return after_failure
