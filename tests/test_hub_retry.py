"""launcher.hub.retry: which failures are retried, how long it waits, and that it stops."""

import httpx2
import pytest
from huggingface_hub.errors import HfHubHTTPError

from launcher.hub.retry import RetryPolicy, is_transient, with_retries
from launcher.hub.retry_loop import attempts, retrying


def _http_error(status: int) -> HfHubHTTPError:
    request = httpx2.Request("POST", "http://127.0.0.1:1/api/models/a/b/commit/main")
    return HfHubHTTPError(f"{status} error", response=httpx2.Response(status, request=request))


def test_transient_failures_are_recognised_through_wrappers():
    assert is_transient(_http_error(500)) and is_transient(_http_error(503)) and is_transient(_http_error(429))
    assert not is_transient(_http_error(404)) and not is_transient(_http_error(412))
    assert is_transient(httpx2.ReadTimeout("timed out"))
    assert is_transient(httpx2.RemoteProtocolError("Server disconnected without sending a response."))
    assert is_transient(OSError("Consistency check failed: file should be of size 10 but has size 5"))
    assert not is_transient(ValueError("bad argument"))
    # The client wraps an LFS upload failure in RuntimeError(...) from the real cause.
    try:
        try:
            raise httpx2.ConnectError("refused")
        except httpx2.ConnectError as exc:
            raise RuntimeError("Error while uploading 'x.pt' to the Hub.") from exc
    except RuntimeError as wrapped:
        assert is_transient(wrapped)


def test_backoff_doubles_up_to_the_cap_and_gives_up_after_the_attempts():
    policy = RetryPolicy(attempts=5, base_delay_s=1.0, max_delay_s=3.0)
    sleeps, calls = [], []

    def always_503():
        calls.append(1)
        raise _http_error(503)

    with pytest.raises(HfHubHTTPError):
        with_retries(always_503, "commit", policy, sleep=sleeps.append)
    assert len(calls) == 5 and sleeps == [1.0, 2.0, 3.0, 3.0]


def test_success_after_transient_failures_and_no_retry_on_real_answers():
    outcomes = [httpx2.ReadTimeout("slow"), _http_error(502), "ok"]

    def flaky():
        result = outcomes.pop(0)
        if isinstance(result, Exception):
            raise result
        return result

    sleeps = []
    assert with_retries(flaky, "x", RetryPolicy(base_delay_s=0.5), sleep=sleeps.append) == "ok"
    assert sleeps == [0.5, 1.0]

    calls = []

    def not_found():
        calls.append(1)
        raise _http_error(404)

    with pytest.raises(HfHubHTTPError):
        with_retries(not_found, "x", RetryPolicy(), sleep=sleeps.append)
    assert len(calls) == 1


def test_the_one_retry_loop_stops_at_a_refused_failure_or_the_last_try():
    """`retrying` with `attempts` (downloads, a writer's conflicts, webhook posts): a failure
    the policy refuses is raised at once, the last try's failure is raised as it is, and
    each retry is heard of and waits its backoff."""
    calls, sleeps, heard = [], [], []

    def fails(exc):
        def fn():
            calls.append(exc)
            raise exc
        return fn
    policy = lambda: attempts(3, lambda e: isinstance(e, KeyError), backoff=lambda n: n / 10,
                              on_retry=lambda e, n: heard.append(n))
    with pytest.raises(ValueError):
        retrying(fails(ValueError("no")), policy(), sleep=sleeps.append)
    assert len(calls) == 1 and sleeps == [] and heard == []
    with pytest.raises(KeyError):
        retrying(fails(KeyError("again")), policy(), sleep=sleeps.append)
    assert len(calls) == 4 and sleeps == [0.1, 0.2] and heard == [1, 2]
    tries = iter([KeyError("once"), None])

    def flaky():
        exc = next(tries)
        if exc is not None:
            raise exc
        return "ok"
    assert retrying(flaky, policy(), sleep=sleeps.append) == "ok"
