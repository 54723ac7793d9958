"""Issue 19's alert goals, measured on this machine.

1. Delivery: an event written by the launcher's EventLog, with the alert router as its
   mirror (as `launch` wires it), reaches a webhook server on 127.0.0.1; delay = the
   server's arrival time minus the event's own `ts`. --alerts events, one at a time (each
   waits for its arrival), in each format, with `per_minute: 600` (distinct incidents at
   this rate would otherwise wait for the default limit of 6 a minute, in a summary).
   Goal: median under 2 s.
2. Supervision poll time: a real Supervisor over the fake backend (tests/support/
   fake_backend.py; 2 GPUs, a metrics line per GPU each poll) timed over --polls polls,
   each poll also raising one alert (a fresh incident, so none is deduplicated), in four
   pods polled in turn (interleaved, so the machine's load hits all alike): two without
   alerts (their difference is the noise), alerts to a webhook that answers, alerts to a
   webhook that never answers. Goal: the never-answering webhook's median poll within the
   noise of the pods without alerts.

    python benchmarks/bench_alerts.py [--alerts 20] [--polls 400] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.alerting import HOOK_ENV, configure_alerts, delivered  # noqa: E402
from tests.support.webhook_server import WebhookServer  # noqa: E402

FORMATS = ("generic", "ntfy", "slack", "discord")


def _router(pod: Path, server: WebhookServer, fmt: str, per_minute: int = 6):
    from launcher.alerts.router import AlertRouter
    from launcher.alerts.webhooks import configured_webhooks
    from launcher.config.podconfig import load_pod_config
    configure_alerts(pod, fmt, alerts={"per_minute": per_minute}, disk_low_gib=0)
    os.environ[HOOK_ENV] = server.url("/hook")
    return AlertRouter(pod, *configured_webhooks(load_pod_config(pod)))


def delivery(root: Path, template: Path, count: int) -> dict:
    from launcher.pod.events import EventLog
    out = {}
    for fmt in FORMATS:
        pod = root / f"delivery-{fmt}"
        shutil.copytree(template, pod)
        with WebhookServer() as server:
            # The rate limit off (20 incidents a minute would pass 6 into summaries): the
            # delay measured is the event's own to the webhook.
            router = _router(pod, server, fmt, per_minute=600)
            log = EventLog(pod, mirror=router)
            delays = []
            for i in range(count):
                record = log.emit("gpu_given_up", gpu=i, reason="benchmark")
                (message,) = server.wait_for(i + 1)[i:]
                assert len(delivered([message], fmt)) == 1
                delays.append(message.at - record["ts"])
            router.close()
        out[fmt] = {"median_s": round(statistics.median(delays), 3),
                    "max_s": round(max(delays), 3)}
    return out


def poll_time(root: Path, template: Path, polls: int) -> dict:
    from launcher.supervise.custodian import CheckpointCustodian
    from launcher.pod.events import EventLog
    from launcher.supervise.plan import load_plan
    from launcher.supervise.supervisor import Supervisor
    from tests.support.fake_backend import FakeBackend

    servers = {"answering": WebhookServer(), "never answering": WebhookServer(mode="hang")}
    pods = {}
    # Two pods without alerts: their difference is the noise the others are judged by.
    for name in ("no alerts", "no alerts (2nd pod)", *servers):
        pod = root / f"poll-{name.replace(' ', '-')}"
        shutil.copytree(template, pod)
        router = _router(pod, servers[name], "generic") if name in servers else None
        plan, manifest = load_plan(pod, 3, "cpu:2", None)
        backend = FakeBackend(pod)
        log = EventLog(pod, mirror=router)
        sup = Supervisor(plan, manifest, CheckpointCustodian.for_plan(plan, manifest, log), log,
                         backend=backend)
        sup.starter.start_all()
        pods[name] = (sup, backend, router, [])
    for i in range(polls):
        for name, (sup, backend, router, times) in pods.items():
            for gpu in (0, 1):
                backend.train(gpu, 1)
            started = time.perf_counter()
            # A fresh incident each poll: the router queues it, the sender posts it.
            sup.pod.events.emit("gpu_outlier", gpu=i % 2, kind=f"straggler-{i}", facts={})
            sup.step()
            times.append(time.perf_counter() - started)
    out = {}
    for name, (sup, backend, router, times) in pods.items():
        ms = sorted(t * 1000 for t in times)
        out[name] = {"median_ms": round(statistics.median(ms), 3),
                     "p90_ms": round(ms[int(0.9 * len(ms))], 3), "max_ms": round(ms[-1], 3)}
        if router is not None:
            router.close(timeout_s=1.0)
            out[name]["dropped"] = sum(s.dropped_total for s in router.senders)
            out[name]["messages"] = len(servers[name].received)
    for server in servers.values():
        server.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--alerts", type=int, default=20)
    parser.add_argument("--polls", type=int, default=400)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from launcher.pod.setup_init import init_pod
    import yaml
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        template = root / "template"
        init_pod(template, "tiny-cpu")
        criteria = template / "manifests" / "trusted_loss.yaml"
        doc = yaml.safe_load(criteria.read_text())
        doc["probe"]["every"] = 0               # no probe processes
        criteria.write_text(yaml.safe_dump(doc))
        load = os.getloadavg()[0]
        result = {"delivery": delivery(root, template, args.alerts),
                  "poll": poll_time(root, template, args.polls),
                  "load_avg": [round(load, 2), round(os.getloadavg()[0], 2)],
                  "alerts": args.alerts, "polls": args.polls}
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
