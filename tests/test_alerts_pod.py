"""Alerts from a supervised pod (issue 19): a real HTTP server on 127.0.0.1 receives, in
each webhook format, the alert of a NaN rollback, a refused hub push, a disk nearly full
and a lost node, once each with its facts; a webhook that answers 500 or never answers
does not hold the supervision loop; the webhook's URL is in no file the pod writes.

A real Supervisor over the fake backend (tests/support/fake_supervisor.py), the alert
router as the EventLog's mirror, as `launch` wires it."""

import shutil

import pytest

from launcher.alerts.router import AlertRouter
from launcher.alerts.webhooks import configured_webhooks
from launcher.config.podconfig import load_pod_config
from launcher.supervise.state import GpuState
from tests.support.alerting import (
    HOOK_ENV,
    SECRET_PATH,
    configure_alerts,
    delivered,
    files_holding,
)
from tests.support.fake_supervisor import (  # noqa: F401 (fixtures)
    crash_past_the_restart_budget,
    events,
    make,
    passed_checkpoint,
    pod_template,
)
from tests.support.webhook_server import WebhookServer

FORMATS = ["generic", "ntfy", "slack", "discord"]


@pytest.fixture
def server():
    with WebhookServer() as running:
        yield running


@pytest.fixture
def hooked(make, tmp_path, pod_template, monkeypatch, server):
    """build(fmt, mode=..., **config) -> (supervisor, backend, clock, router): the pod's
    config alerts to `server`, the router mirrors its EventLog."""
    def build(fmt, mode="ok", stage=3, nodes=None, sender=None, **config):
        pod = tmp_path / "pod"
        shutil.copytree(pod_template, pod)
        configure_alerts(pod, fmt, disk_low_gib=config.pop("disk_low_gib", 0), **config)
        server.mode = mode
        monkeypatch.setenv(HOOK_ENV, server.url(SECRET_PATH))
        settings, hooks = configured_webhooks(load_pod_config(pod))
        router = AlertRouter(pod, settings, hooks, **{"batch_s": 0.05, **(sender or {})})
        sup, backend, clock = make(stage=stage, nodes=nodes, mirror=router)
        routers.append(router)
        return sup, backend, clock, router
    routers = []
    yield build
    for router in routers:
        router.close(timeout_s=0.5)     # a hung webhook is left to its daemon thread


def all_delivered(router, server, fmt) -> list[dict]:
    """Every alert the server received once the router delivered all it holds."""
    router.close()
    return delivered(server.received, fmt)


def assert_url_nowhere(sup):
    assert files_holding(sup.pod.pod_dir, SECRET_PATH) == []
    assert files_holding(sup.pod.pod_dir, "xoxSecretToken123") == []


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_nan_rollback_is_alerted_once_with_gpu_stages_tokens_and_why(hooked, server, fmt):
    sup, backend, clock, router = hooked(fmt)
    sup.starter.start_all()
    good = passed_checkpoint(sup, backend, 0)
    backend.train(0, 10)
    backend.event(0, "nan", step=112)
    sup.step()
    sup.step()
    (rollback,) = events(sup, "rollback", gpu=0)
    assert rollback["to_token"] == good["next_token"]
    (alert,) = all_delivered(router, server, fmt)
    if fmt == "generic":
        facts = alert["facts"]
        assert (facts["gpu"], facts["from_stage"], facts["to_stage"]) == (0, 3, 2)
        assert facts["to_token"] == good["next_token"] and "nan" in facts["reason"].lower()
    assert "GPU 0 rolled back: stage 3 -> 2" in alert["title"]
    assert f"{good['next_token']:,}" in alert["title"] and "nan" in alert["title"].lower()
    (sent,) = events(sup, "alert_sent")
    assert sent["alert"] == "rollback" and sent["webhook"] == f"{fmt} (${HOOK_ENV})"
    assert_url_nowhere(sup)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_push_refused_by_a_takeover_is_alerted_once_as_critical(hooked, server, fmt,
                                                                  tmp_path):
    from launcher.hub import open_store
    from launcher.hub.lease import take_over
    sup, backend, clock, router = hooked(fmt, stage=1)
    sup.starter.start_all()
    passed_checkpoint(sup, backend, 0)
    new = tmp_path / "elsewhere"
    new.mkdir()
    lease = take_over(open_store(sup.pod.custodian.sync.store.url, new), new)
    sup.pod.custodian.sync.finish()      # the run's last push: refused, the run is not ours
    sup.pod.custodian.sync.finish()
    (refused,) = events(sup, "hub_taken_over")
    (alert,) = all_delivered(router, server, fmt)
    assert "hub push REFUSED" in alert["title"] and lease["pod_id"] in alert["title"]
    assert "[critical]" in alert["text"] or '"critical"' in alert["text"]
    if fmt == "generic":
        assert alert["facts"]["error"] == refused["error"]
    assert_url_nowhere(sup)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_disk_nearly_full_is_alerted_once_before_it_is_full(hooked, server, fmt):
    from launcher.supervise.disk_watch import CHECK_EVERY_S
    # A threshold above any real disk's free space: this disk is "nearly full".
    sup, backend, clock, router = hooked(fmt, disk_low_gib=10**8)
    sup.starter.start_all()
    for _ in range(3):
        sup.step()
        clock.now += CHECK_EVERY_S       # each step checks again: still low, said once
    (low,) = events(sup, "disk_low")
    assert low["threshold_gib"] == 10**8 and 0 < low["free_gib"] < 10**8
    (alert,) = all_delivered(router, server, fmt)
    assert "disk nearly full" in alert["title"] and f"{low['free_gib']} GiB" in alert["title"]
    if fmt == "generic":
        assert alert["facts"] == {k: v for k, v in low.items() if k not in ("ts", "event")}
    assert sup.pod.running()            # a warning, not a stop
    assert_url_nowhere(sup)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_lost_node_is_alerted_with_where_its_gpu_resumed(hooked, server, fmt):
    """The Ray backend's node loss, through the fake backend (the `ray` developer runs the
    real cluster): node_lost, then the GPU's new node, each once."""
    sup, backend, clock, router = hooked(fmt, nodes={"node-a": 1, "node-b": 2})
    sup.starter.start_all()
    on_hub = passed_checkpoint(sup, backend, 0)
    sup.pod.custodian.copies.hub[0] = {**on_hub, "path": "checkpoints/fractus_1b_gpu0.pt",
                      "hub_revision": "rev-1"}
    backend.lose_node("node-a")
    sup.step()
    sup.step()
    assert sup.pod.runs[0].state is GpuState.RUNNING and sup.pod.runs[0].node == "node-b"
    titles = sorted(a["title"] for a in all_delivered(router, server, fmt))
    assert len(titles) == 2, titles
    assert "node node-a lost: GPU 0 stopped" in titles[1]
    assert "GPU 0 (lost with node node-a) resumed on node node-b" in titles[0]
    assert f"from token {on_hub['next_token']:,}" in titles[0]
    assert_url_nowhere(sup)


@pytest.mark.parametrize("mode", ["500", "hang"])
def test_a_webhook_that_fails_or_hangs_never_holds_the_supervision_loop(hooked, server, mode):
    """The loop's steps that raise alerts return while the webhook still holds the first
    POST (`hang`: its 60 s timeout has not run out, no alert_failed yet), or fail it
    (`500`: recorded as alert_failed after bounded retries, without the URL)."""
    sup, backend, clock, router = hooked(
        "generic", mode=mode, disk_low_gib=10**8,
        sender={"timeout_s": 60.0, "backoff_s": 0.01, "queue_size": 4})
    sup.starter.start_all()
    sup.step()                                   # disk_low: the first alert
    server.wait_for(1)                           # its POST is at the webhook now
    good = passed_checkpoint(sup, backend, 0)
    for gpu in (0, 1):                           # more alerts while the webhook is stuck
        backend.event(gpu, "nan", step=200)
    sup.step()
    sup.step()
    assert events(sup, "rollback", gpu=0)[0]["to_token"] == good["next_token"]
    if mode == "hang":
        assert not events(sup, "alert_failed")   # the first POST is still held
        assert len(server.received) == 1
    else:
        router.close()
        failed = events(sup, "alert_failed")
        assert failed and all(f["error"].startswith("HTTP 500") and f["attempts"] == 3
                              for f in failed)
    assert_url_nowhere(sup)


def test_a_gpu_given_up_and_the_pod_failed_are_told_as_critical_in_one_summary(hooked, server):
    """Crashes past the restart budget at stage 1: the GPU is given up (a new event) and
    the pod fails in the same poll; both reach the webhook, together."""
    sup, backend, clock, router = hooked("generic", stage=1, sender={"batch_s": 1.0})
    sup.starter.start_all()
    crash_past_the_restart_budget(sup, backend, clock)
    (given_up,) = events(sup, "gpu_given_up", gpu=0)
    assert "4 crashes within 900s" in given_up["reason"]
    alerts = all_delivered(router, server, "generic")
    assert [a["title"].split(":")[0] for a in alerts] == ["GPU 0 given up",
                                                          "pod FAILED at stage 1"]
    (message,) = server.received
    assert message.json()["severity"] == "critical"
