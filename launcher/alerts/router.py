"""The EventLog's mirror that turns events into alerts; called on the writer's thread, so it
is quick and never raises. An alert whose key was said less than `repeat_after_s` ago is
dropped here."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from launcher.alerts.formats import pod_label
from launcher.alerts.rules import AlertRules
from launcher.alerts.senders import WebhookSender
from launcher.alerts.webhooks import Webhook
from launcher.config.alerts import AlertSettings
from launcher.pod.events import EventLog


class AlertRouter:
    def __init__(self, pod_dir: Path, settings: AlertSettings, hooks: list[Webhook],
                 **sender_options):
        self.settings = settings
        self.rules = AlertRules(settings)
        self.said: dict[str, float] = {}        # incident key -> when it was last said
        # Deliveries go through a log without mirrors: never back into this router or TensorBoard.
        record = EventLog(pod_dir).emit
        self.senders = [WebhookSender(h, pod_label(pod_dir), record, settings.per_minute,
                                      **sender_options) for h in hooks]
        # Events are written by the loop, and by a backend's or the hub sync's threads.
        self._lock = threading.Lock()

    def __call__(self, record: dict) -> None:
        try:
            with self._lock:
                alert = self.rules.alert_for(record)
                if alert is None or not self.settings.wants(alert.severity):
                    return
                now = time.monotonic()
                last = self.said.get(alert.key)
                if last is not None and now - last < self.settings.repeat_after_s:
                    return
                self.said[alert.key] = now
            for sender in self.senders:
                sender.put(alert)
        except Exception:        # an alert is never worth a supervision step
            pass

    def close(self, timeout_s: float = 10.0) -> None:
        """Deliver what is queued, for at most `timeout_s` in all."""
        deadline = time.monotonic() + timeout_s
        for sender in self.senders:
            sender.stop()
        for sender in self.senders:
            sender.join(deadline)
