"""The hub rate-limiting the pod: waits never shorter than the hub asked, bounded in all,
recorded (logs/hub.log, events, logs/hub_rate.json for `status`); a commit whose answer was
lost is looked for on the hub before it is sent again. Real HfApi against the test hub; the
waits are recorded, not slept (launcher.hub.retry_loop._sleep)."""

import json
import logging
import os
import time
from pathlib import Path

import httpx2
import pytest
from huggingface_hub.errors import HfHubHTTPError

from launcher.hub import RetryPolicy, open_store
from launcher.hub import retry_loop
from launcher.hub.hub_rate import (commits_last_hour, note_wait, rate_line, rate_report,
                                     read_hub_rate)
from launcher.hub.retry import RateLimited, told_wait, with_retries
from launcher.hub.sync import HubSync, RunLease
from launcher.hub.sync_state import read_sync_state
from launcher.config.podconfig import load_pod_config
from launcher.pod.ckpt_index import CheckpointIndex
from launcher.pod.events import EventLog
from launcher.pod.manifest import read_manifest
from tests.support.hub_pod import add_passed, pod  # noqa: F401  (pytest fixture)
from tests.support.pod_files import write_file
from tests.support.hub_server import test_hub  # noqa: F401  (pytest fixture)

pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")

REPO = "fractus/run-rl"
CKPT = "checkpoints/fractus_1b_gpu0.pt"
POLICY = RetryPolicy(attempts=3, base_delay_s=1.0, max_delay_s=30.0, rate_limit_wait_s=600.0)


def _answer(status: int, headers: dict) -> HfHubHTTPError:
    request = httpx2.Request("POST", "http://127.0.0.1:1/api/models/a/b/commit/main")
    return HfHubHTTPError(f"{status}", response=httpx2.Response(status, headers=headers,
                                                                request=request))


@pytest.fixture
def slept(monkeypatch):
    waits: list[float] = []
    monkeypatch.setattr(retry_loop, "_sleep", waits.append)
    return waits


def _events(pod: Path) -> list[dict]:
    path = pod / "logs" / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def events_of(pod: Path, kind: str) -> list[dict]:
    return [e for e in _events(pod) if e["event"] == kind]


def test_the_wait_the_hub_names_is_read_from_each_header():
    assert told_wait(_answer(429, {"Retry-After": "30"})) == 30
    assert told_wait(_answer(429, {"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"}),
                     now=1445412470.0) == 10       # an HTTP date: the seconds until then
    limited = {"RateLimit": '"api";r=0;t=55', "RateLimit-Policy": '"fixed window";"api";q=500;w=300'}
    assert told_wait(_answer(429, limited)) == 55
    assert told_wait(_answer(429, {"RateLimit": '"api";r=12;t=55'})) is None   # quota left
    assert told_wait(_answer(429, {})) is None


def test_a_429_is_retried_no_earlier_than_retry_after_and_the_wait_is_bounded(slept):
    calls = []

    def limited():
        calls.append(1)
        raise _answer(429, {"Retry-After": "30"})

    with pytest.raises(RateLimited) as refused:
        with_retries(limited, "committing", POLICY)
    # 20 waits of 30 s fill the 600 s bound; the 21st answer ends it: never earlier, never
    # for ever, and the rate-limited tries did not spend the 3 attempts of other failures.
    assert slept == [30.0] * 20 and len(calls) == 21
    assert refused.value.retry_at > 0 and "rate-limiting" in str(refused.value)

    slept.clear()
    outcomes = [_answer(429, {}), _answer(429, {}), _answer(429, {"Retry-After": "0"}),
                _answer(429, {"Retry-After": "1"}), "ok"]

    def named_nothing():
        out = outcomes.pop(0)
        if isinstance(out, Exception):
            raise out
        return out

    assert with_retries(named_nothing, "x", POLICY) == "ok"
    # No wait named: backoff from 5 s; after a first 429, a named wait shorter than that
    # backoff (0 s, 1 s) does not make the pod hammer.
    assert slept == [5.0, 10.0, 10.0, 20.0]


def test_a_rate_limited_commit_waits_is_recorded_and_lands(test_hub, tmp_path, slept, caplog):
    pod = tmp_path / "pod"
    write_file(pod, CKPT, os.urandom(4096))
    store = open_store(f"hf://{REPO}", pod, retry=POLICY)
    test_hub.faults.add("commit", "status", count=3, status=429,
                        headers={"Retry-After": "30"})
    with caplog.at_level(logging.INFO, logger="launcher.hub"):
        revision = store.push([CKPT], "rate-limited")

    assert slept == [30.0, 30.0, 30.0]
    titles = [c.title for c in test_hub.commits(REPO)]      # the repo's own first commit too
    assert len(test_hub.routed("commit", "POST")) == 4 and titles.count("rate-limited") == 1
    assert "rate-limited" in caplog.text and "retry in 30.0s" in caplog.text
    kinds = [e["event"] for e in _events(pod)]
    assert kinds.count("hub_rate_limited") == 1 and kinds.count("hub_rate_limit_ended") == 1
    ended = [e for e in _events(pod) if e["event"] == "hub_rate_limit_ended"][0]
    assert ended["waits"] == 3 and ended["pushes_delayed"] == 1
    state = read_hub_rate(pod)
    assert state["limited"] is None and state["last_incident"]["waited_s"] == 90
    assert state["last_commit"] == revision and commits_last_hour(state) == 1


def test_status_line_says_since_when_and_the_pushes_delayed(test_hub, tmp_path, slept):
    pod = tmp_path / "pod"
    write_file(pod, CKPT, os.urandom(4096))
    store = open_store(f"hf://{REPO}", pod,
                       retry=RetryPolicy(attempts=3, base_delay_s=1, rate_limit_wait_s=60))
    test_hub.faults.add("commit", "status", count=10, status=429, headers={"Retry-After": "30"})
    with pytest.raises(RateLimited):
        store.push([CKPT], "given up for now")
    assert slept == [30.0, 30.0]
    assert "given up for now" not in [c.title for c in test_hub.commits(REPO)]
    line = rate_line(rate_report(pod), 128)
    assert line.startswith("hub: RATE-LIMITED since ") and "2 waits, 1 push delayed" in line
    assert "0 commits in the last hour (budget 128/hour)" in line


@pytest.mark.parametrize("lost", ["drop_after", "status_after"])
def test_a_commit_whose_answer_was_lost_is_found_on_the_hub_not_sent_again(
        test_hub, tmp_path, lost):
    pod = tmp_path / "pod"
    write_file(pod, CKPT, os.urandom(4096))
    store = open_store(f"hf://{REPO}", pod,
                       retry=RetryPolicy(attempts=4, base_delay_s=0.01, max_delay_s=0.05))
    store.push([CKPT], "first")
    write_file(pod, CKPT, os.urandom(4096))
    # The hub applies the commit, then the connection drops, or a gateway answers 504.
    test_hub.faults.add("commit", lost, status=504)
    before = len(test_hub.routed("commit", "POST"))
    revision = store.push([CKPT], "second")

    titles = [c.title for c in test_hub.commits(REPO)]
    assert test_hub.commits(REPO)[0].oid == revision and titles.count("second") == 1
    assert len(test_hub.routed("commit", "POST")) - before == 1   # sent once, found after
    assert read_hub_rate(pod)["last_commit"] == revision and commits_last_hour(read_hub_rate(pod)) == 2


def test_a_sync_push_the_hub_keeps_limiting_is_delayed_to_its_retry_time_then_lands(
        test_hub, pod, slept):
    config_file = pod / "fractus-pod.yaml"
    config_file.write_text(config_file.read_text().replace("hub: file://hub", f"hub: hf://{REPO}"))
    add_passed(pod, 0, 100)
    config = load_pod_config(pod)
    log = EventLog(pod)
    sync = HubSync(pod, config, read_manifest(pod / config.manifest), CheckpointIndex(pod),
                   log, RunLease(pod, log))       # sync interval: 600 s (tiny-cpu)
    test_hub.faults.add("commit", "status", count=10**6, status=429,
                        headers={"Retry-After": "30"})
    sync.next_due = time.monotonic()              # the interval push is due now
    sync.tick()
    sync._thread.join()
    sync.tick()                                   # harvests: delayed, not failed

    assert sum(slept) == 600 and not events_of(pod, "sync_failed")
    delayed = events_of(pod, "sync_delayed")
    assert len(delayed) == 1 and "rate-limiting" in delayed[0]["error"]
    state = read_sync_state(pod)
    assert state["last_result"] == "delayed" and round(state["delayed_until"], 3) == delayed[0]["retry_at"]
    # Tried again when the hub said (30 s), not at the next interval (600 s); nothing before.
    assert sync.hold_until == sync.next_due and sync.next_due - time.monotonic() <= 30
    sync.manifest_changed("rollback")             # not even a manifest change jumps the wait
    sync.tick()
    assert not sync.busy

    test_hub.faults.clear()
    sync.hold_until = sync.next_due = time.monotonic()    # the hub's 30 s have passed
    sync.tick()
    sync.finish()
    pushed = events_of(pod, "sync_pushed")
    assert pushed and read_sync_state(pod)["last_result"] == "ok"
    ended = events_of(pod, "hub_rate_limit_ended")
    assert len(ended) == 1 and ended[0]["pushes_delayed"] == 1 and read_hub_rate(pod)["limited"] is None


def test_against_a_hub_limiting_commits_per_window_no_retry_comes_early(test_hub, tmp_path):
    """The test hub's quota (2 commits per 2 s window, then 429 with Retry-After and
    RateLimit as the Hub sends them): every push lands, none of them before its 429's
    Retry-After, each a real wait."""
    pod = tmp_path / "pod"
    store = open_store(f"hf://{REPO}", pod, retry=RetryPolicy(attempts=2, base_delay_s=0.1))
    test_hub.rate_limits.set("commit", limit=2, window_s=2.0, method="POST")
    revisions = []
    for n in range(4):
        write_file(pod, CKPT, os.urandom(1024))
        revisions.append(store.push([CKPT], f"push {n}"))
    titles = [c.title for c in test_hub.commits(REPO)]
    assert all(titles.count(f"push {n}") == 1 for n in range(4))
    assert test_hub.rate_limits.answered_429 >= 1 and test_hub.rate_limits.early == 0
    assert len(events_of(pod, "hub_rate_limited")) == len(events_of(pod, "hub_rate_limit_ended"))


def test_an_incident_a_process_left_open_ends_at_the_next_answer_of_another(test_hub, tmp_path):
    pod = tmp_path / "pod"
    pod.mkdir()
    note_wait(pod, "committing", 30.0, 30.0, push="p1")     # a launcher killed while waiting
    assert rate_report(pod)["limited"]["waits"] == 1
    assert open_store(f"hf://{REPO}", pod, retry=POLICY).head() is None   # answered (404)
    assert rate_report(pod)["limited"] is None and len(events_of(pod, "hub_rate_limit_ended")) == 1
