"""`fractus-pod alert test`: a test message to each webhook of the pod config's `alerts:`,
one line per webhook (named by its variable, never its URL); exit 0 when every one took
it, 1 when one failed, 2 when there is nothing to test or a URL is missing or not http(s)."""

from __future__ import annotations

import sys
import time

import click

from launcher.cli.options import pod_dir_of, pod_dir_option
from launcher.alerts.formats import pod_label, render
from launcher.alerts.rules import Alert
from launcher.alerts.webhooks import DeliveryError, configured_webhooks, post
from launcher.config.podconfig import load_pod_config
from launcher.errors import UserError
from launcher.paths import CONFIG_NAME


@click.group()
def alert() -> None:
    """The pod's alert webhooks (alerts: in fractus-pod.yaml)."""


@alert.command("test")
@pod_dir_option
@click.pass_context
def test_alerts(ctx) -> None:
    """Send a test message to each configured webhook."""
    pod_dir = pod_dir_of(ctx)
    alerting = configured_webhooks(load_pod_config(pod_dir))
    if alerting is None:
        raise UserError(f"no alerts: in {pod_dir / CONFIG_NAME}; add alerts: {{webhooks: "
                        f"[{{format: ntfy, url_env: NTFY_URL}}]}} (docs/LAUNCHER.md)")
    _, hooks = alerting
    sample = Alert("alert_test", "info", "alert_test",
                   "test message: alerts from this pod reach you here", {}, time.time())
    failed = 0
    for hook in hooks:
        body, headers = render(hook.format, [sample], pod_label(pod_dir))
        try:
            status = post(hook, body, headers, timeout_s=10.0)
            click.echo(f"ok      {hook.name}: HTTP {status}")
        except DeliveryError as exc:
            failed += 1
            click.echo(f"FAILED  {hook.name}: {exc}")
    sys.exit(1 if failed else 0)
