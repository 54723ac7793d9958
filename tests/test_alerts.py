"""The alert machinery alone (issue 19): settings parsed once with bad values refused,
each format's message as a real server receives it, the rules that need history (a hub
failing for N intervals, a lost node's GPU followed), one message per incident (dedupe,
a summary of what fires at once, a rate limit), a bounded queue that never blocks, and
`fractus-pod alert test`."""

import time

import pytest

from launcher.alerts.router import AlertRouter
from launcher.alerts.rules import AlertRules
from launcher.alerts.webhooks import Webhook
from launcher.cli import main as cli_main
from launcher.config.alerts import AlertSettings, WebhookSetting
from launcher.pod.setup_init import init_pod
from launcher.errors import UserError
from launcher.pod.events import read_events
from tests.support.alerting import HOOK_ENV, SECRET_PATH, configure_alerts, delivered
from tests.support.webhook_server import WebhookServer


@pytest.fixture
def server():
    with WebhookServer() as running:
        yield running


def router_to(server, pod_dir, fmt="generic", **settings) -> AlertRouter:
    options = {k: settings.pop(k) for k in ("batch_s", "queue_size", "timeout_s")
               if k in settings}
    config = AlertSettings(webhooks=(WebhookSetting(fmt, HOOK_ENV),), **settings)
    hooks = [Webhook(config.webhooks[0], server.url(SECRET_PATH))]
    return AlertRouter(pod_dir, config, hooks, **options)


def record(event, **fields) -> dict:
    return {"ts": time.time(), "event": event, **fields}


# ---- settings ------------------------------------------------------------------------
@pytest.mark.parametrize("alerts, says", [
    ({"webhooks": [{"format": "teams", "url_env": "X"}]}, "format must be one of"),
    ({"webhooks": [{"format": "ntfy", "url": "https://ntfy.sh/x"}]}, "unknown key(s) ['url']"),
    ({"webhooks": [{"format": "ntfy", "url_env": "https://ntfy.sh/x"}]},
     "url_env must name the environment variable"),
    ({"webhooks": []}, "webhooks must be a list"),
    ({"webhooks": [{"format": "ntfy", "url_env": "X"}], "min_severity": "loud"},
     "min_severity must be one of"),
    ({"webhooks": [{"format": "ntfy", "url_env": "X"}], "per_minute": 0},
     "per_minute must be an integer from 1"),
    ({"webhooks": [{"format": "ntfy", "url_env": "X"}], "hub_failures": 2.5},
     "hub_failures must be an integer"),
])
def test_bad_alert_settings_are_refused_naming_the_value(alerts, says):
    with pytest.raises(UserError) as refused:
        AlertSettings.parse(alerts)
    assert says in str(refused.value)


def test_severity_threshold_keeps_what_is_at_or_above_it():
    settings = AlertSettings.parse({"webhooks": [{"format": "slack", "url_env": "S"}],
                                    "min_severity": "warning"})
    assert [settings.wants(s) for s in ("info", "warning", "critical")] == [False, True, True]


# ---- formats, as a real server receives them -------------------------------------------
@pytest.mark.parametrize("fmt", ["generic", "ntfy", "slack", "discord"])
def test_each_format_delivers_title_and_facts(server, tmp_path, fmt):
    router = router_to(server, tmp_path, fmt)
    router(record("pod_failed", stage=3, reason="disk full: 0 bytes free"))
    router.close()
    (message,) = server.wait_for(1)
    (alert,) = delivered([message], fmt)
    assert "pod FAILED at stage 3: disk full: 0 bytes free" in alert["title"]
    assert message.path == SECRET_PATH
    if fmt == "ntfy":
        assert message.headers["Priority"] == "urgent"
        assert "rotating_light" in message.headers["Tags"]
        assert "reason: disk full" in message.text
    elif fmt == "generic":
        body = message.json()
        assert (body["event"], body["severity"]) == ("pod_failed", "critical")
        assert body["facts"] == {"stage": 3, "reason": "disk full: 0 bytes free"}
        assert body["pod"].endswith(tmp_path.name)
    else:
        assert message.headers["Content-Type"] == "application/json"


# ---- rules with history ---------------------------------------------------------------
def test_a_hub_failing_is_one_incident_after_n_intervals_and_a_new_one_after_recovery():
    rules = AlertRules(AlertSettings(hub_failures=3))
    failed = record("sync_failed", reason="interval", error="HTTP 503",
                    retry="at the next interval")
    made = [rules.alert_for(failed) for _ in range(4)]
    assert made[:2] == [None, None]
    assert made[2].key == made[3].key and "3 intervals in a row" in made[2].title
    assert rules.alert_for(record("sync_pushed", reason="interval")) is None
    again = [rules.alert_for(failed) for _ in range(3)]
    assert again[2] is not None and again[2].key != made[2].key


def test_a_push_of_the_run_end_that_fails_is_alerted_at_once():
    rules = AlertRules(AlertSettings())
    alert = rules.alert_for(record("sync_failed", reason="final", error="HTTP 503",
                                   retry="none"))
    assert alert.severity == "warning" and "not retried" in alert.title


def test_a_lost_gpu_waiting_for_a_node_names_the_node_it_lost():
    rules = AlertRules(AlertSettings())
    rules.alert_for(record("node_lost", gpu=5, node="n1", stage=3))
    waiting = rules.alert_for(record("gpu_waiting", gpu=5, reason="no node has a free device"))
    assert "GPU 5 (lost with node n1) waits: no node has a free device" == waiting.title
    assert rules.alert_for(record("worker_start", gpu=4, node="n2")) is None   # not lost


def test_a_stage_switch_is_told_passed_as_info_and_refused_as_warning():
    rules = AlertRules(AlertSettings())
    passed = rules.alert_for(record("canary", passed=True, from_stage=2, to_stage=3,
                                    reason="ok", per_step=[{"step": 1}] * 300))
    refused = rules.alert_for(record("canary", passed=False, from_stage=2, to_stage=3,
                                     reason="ema_tf rose 0.4 > 0.2"))
    assert (passed.severity, passed.title) == ("info", "stage switch 2 -> 3 passed the canary")
    assert "per_step" not in passed.facts          # hundreds of rows stay in status
    assert refused.severity == "warning" and refused.title == \
        "stage switch 2 -> 3 REFUSED by the canary: ema_tf rose 0.4 > 0.2"


def test_a_gpu_outlier_from_the_peers_check_is_routed_once_per_incident():
    """The peers check's event (branch goodput: gpu, kind, value, median, threshold)."""
    rules = AlertRules(AlertSettings())
    outlier = record("gpu_outlier", gpu=3, kind="straggler", value=300.0, median=1000.0,
                     threshold=700.0, window=5, action="alert")
    first = rules.alert_for(outlier)
    assert first.severity == "warning" and first.title == \
        "GPU 3 off its peers (straggler): 300 vs its peers' median 1000 (threshold 700)"
    assert first.facts["median"] == 1000.0
    assert rules.alert_for(outlier).key == first.key          # the same incident
    rules.alert_for(record("gpu_outlier_cleared", gpu=3, kind="straggler"))
    assert rules.alert_for(outlier).key != first.key          # back with them, then off again


def test_a_refused_merge_round_is_an_alert_an_adopted_one_is_not():
    rules = AlertRules(AlertSettings())
    assert rules.alert_for(record("merge_round", round=3, verdict="adopted", reason="ok")) is None
    refused = rules.alert_for(record("merge_round", round=4, verdict="refused",
                                     reason="GPU 1's next-window loss rises by 0.3"))
    assert (refused.severity, refused.key) == ("warning", "merge_round:4")
    assert refused.title == ("merge round 4 refused, the GPUs train on with their own "
                             "weights: GPU 1's next-window loss rises by 0.3")


# ---- one message per incident ----------------------------------------------------------
def test_the_same_incident_is_said_once(server, tmp_path):
    router = router_to(server, tmp_path)
    for _ in range(3):
        router(record("hub_taken_over", reason="interval", error="run taken over by pod B"))
    router.close()
    assert len(server.received) == 1
    (sent,) = [e for e in read_events(tmp_path) if e["event"] == "alert_sent"]
    assert sent["keys"] == ["hub_taken_over"] and SECRET_PATH not in str(sent)


def test_alerts_firing_at_once_go_out_as_one_summary(server, tmp_path):
    router = router_to(server, tmp_path, batch_s=2.0)
    for gpu in range(8):
        router(record("node_lost", gpu=gpu, node="n1", stage=3))
    router.close()
    (message,) = server.wait_for(1)
    body = message.json()
    assert body["event"] == "summary" and len(body["alerts"]) == 8
    assert body["title"].endswith(": 8 alerts")


def test_past_the_rate_limit_alerts_wait_and_go_out_together(server, tmp_path):
    router = router_to(server, tmp_path, per_minute=1, batch_s=0.01)
    router(record("pod_failed", stage=3, reason="first"))
    server.wait_for(1)
    for gpu in (1, 2):
        router(record("gpu_given_up", gpu=gpu, reason="crashes"))
    time.sleep(0.5)        # long past the batch window: only the rate limit holds them
    assert len(server.received) == 1
    router.close()         # the end of the launcher: what waits goes out now, as one
    second = server.wait_for(2)[1].json()
    assert [a["facts"]["gpu"] for a in second["alerts"]] == [1, 2]


def test_a_hung_webhook_fills_its_bounded_queue_and_never_blocks_the_caller(tmp_path):
    with WebhookServer(mode="hang") as server:
        router = router_to(server, tmp_path, batch_s=0.0, queue_size=2, timeout_s=60.0)
        started = time.monotonic()
        for gpu in range(200):
            router(record("gpu_given_up", gpu=gpu, reason="crashes"))
        # 200 puts into a queue of 2 whose thread is stuck in a 60 s POST: none waited.
        assert time.monotonic() - started < 30
        (held,) = server.wait_for(1)
        body = held.json()
        in_message = len(body.get("alerts", [body]))
        # What the queue refused is counted, and said in the next message sent.
        dropped = router.senders[0].dropped + body.get("dropped", 0)
        # Kept: the message being posted and at most the queue's 2; the rest refused.
        assert 200 - 2 <= in_message + dropped <= 200
        router.close(timeout_s=0.2)


# ---- fractus-pod alert test -------------------------------------------------------------
@pytest.mark.parametrize("mode, code, says", [("ok", 0, "ok      generic"),
                                              ("500", 1, "FAILED  generic")])
def test_alert_test_sends_one_message_per_webhook(tmp_path, monkeypatch, capsys, mode, code,
                                                  says):
    pod = tmp_path / "pod"
    init_pod(pod, "tiny-cpu")
    configure_alerts(pod, "generic")
    with WebhookServer(mode=mode) as server:
        monkeypatch.setenv(HOOK_ENV, server.url(SECRET_PATH))
        assert cli_main(["--pod-dir", str(pod), "alert", "test"]) == code
        received = server.received
    out = capsys.readouterr().out
    assert out.startswith(says) and len(out.splitlines()) == 1
    assert SECRET_PATH not in out and "127.0.0.1" not in out
    assert received[0].json()["event"] == "alert_test"


# ---- a real launch -------------------------------------------------------------------------
def test_a_real_launch_sends_its_alerts_before_it_exits_and_writes_no_url(tmp_path):
    """`launch` wires the router as the EventLog's mirror (after the TensorBoard run) and
    delivers what is queued before it exits: the pod's last alert is its end."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.support.alerting import files_holding
    repo = Path(__file__).resolve().parents[1]
    pod = tmp_path / "pod"
    assert cli_main(["--pod-dir", str(pod), "init"]) == 0
    configure_alerts(pod, "slack", alerts={"min_severity": "info"}, disk_low_gib=0)
    with WebhookServer() as server:
        env = {**os.environ, HOOK_ENV: server.url(SECRET_PATH), "PYTHONPATH": str(repo)}
        done = subprocess.run([sys.executable, "-m", "launcher.cli", "--pod-dir", str(pod),
                               "launch", "--stage", "1", "--gpus", "0", "--max-steps", "3"],
                              env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        received = list(server.received)    # nothing waited for: sent before the exit
    titles = [a["title"] for a in delivered(received, "slack")]
    assert any("pod done at stage 1" in t for t in titles), titles
    assert [e["alert"] for e in read_events(pod) if e["event"] == "alert_sent"] == ["pod_done"]
    assert files_holding(pod, SECRET_PATH) == []
    assert SECRET_PATH not in done.stdout + done.stderr


def test_an_alert_still_goes_out_when_the_tensorboard_mirror_meets_a_full_disk(tmp_path):
    """The mirrors are the TensorBoard run first, then the alerts: a write failing on a
    full disk in the first must not keep the pod_failed of that full disk from the second."""
    import errno

    from launcher.pod.events import EventLog, Mirrors

    def full_disk(record):
        raise OSError(errno.ENOSPC, "No space left on device")
    seen = []
    alerts = seen.append
    log = EventLog(tmp_path, mirror=Mirrors(full_disk, alerts))
    with pytest.raises(OSError):
        log.emit("pod_failed", stage=3, reason="disk full")
    assert [r["event"] for r in seen] == ["pod_failed"]
