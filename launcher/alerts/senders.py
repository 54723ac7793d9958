"""One background thread per webhook delivering its bounded queue; it never blocks or crashes
the supervision loop. What fires within `batch_s` goes as one summary; at most `per_minute`
messages a minute; bounded retries; a full queue drops and counts. Each delivery is recorded
(`alert_sent` / `alert_failed`, the webhook named by its variable, never its URL).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from typing import Callable

from launcher.alerts.formats import render
from launcher.alerts.rules import Alert, worst
from launcher.alerts.webhooks import DeliveryError, Webhook, post
from launcher.hub.redact import scrub
from launcher.hub.retry_loop import attempts, retrying

_STOP = object()


class WebhookSender:
    def __init__(self, hook: Webhook, pod: str, record: Callable[..., None], per_minute: int,
                 queue_size: int = 256, attempts: int = 3, timeout_s: float = 5.0,
                 backoff_s: float = 1.0, batch_s: float = 0.3):
        self.hook, self.pod, self.record = hook, pod, record
        self.per_minute, self.attempts = per_minute, attempts
        self.timeout_s, self.backoff_s, self.batch_s = timeout_s, backoff_s, batch_s
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._sent_at: deque = deque()          # monotonic times of the last minute's sends
        self._closing = threading.Event()
        self.dropped = 0              # alerts a full queue refused, until the next message
        self.dropped_total = 0
        self._thread: threading.Thread | None = None

    def put(self, alert: Alert) -> None:
        """Never blocks: a hung webhook fills its queue, not the supervision loop."""
        if self._thread is None:    # started at the first alert (after a --detach fork)
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name=f"alerts {self.hook.name}")
            self._thread.start()
        try:
            self._queue.put_nowait(alert)
        except queue.Full:
            self.dropped += 1
            self.dropped_total += 1

    def stop(self) -> None:
        """Send what is queued now (no rate limit, no more waiting), then end."""
        if self._thread is None:
            return
        self._closing.set()
        try:
            self._queue.put_nowait(_STOP)
        except queue.Full:          # a hung webhook's full queue: the thread is left
            pass

    def join(self, deadline: float) -> None:
        """Wait for the thread until monotonic `deadline` (a daemon: never past exit)."""
        if self._thread is not None:
            self._thread.join(max(0.0, deadline - time.monotonic()))

    # ---- the thread -----------------------------------------------------------------
    def _run(self) -> None:
        stopping = False
        while not stopping:
            first = self._queue.get()
            if first is _STOP:
                return
            batch, stopping = self._gather([first])
            try:
                self._deliver(batch)
            except Exception:       # never let one message end the thread
                pass

    def _gather(self, batch: list[Alert]) -> tuple[list[Alert], bool]:
        """What else fires within batch_s, and past the rate limit until a send is due."""
        until = time.monotonic() + self.batch_s
        while True:
            now = time.monotonic()
            while self._sent_at and self._sent_at[0] < now - 60:
                self._sent_at.popleft()
            limited = len(self._sent_at) >= self.per_minute and not self._closing.is_set()
            if limited:
                until = max(until, self._sent_at[0] + 60)
            if now >= until:
                return self._drain(batch)
            if limited:
                # Held by the rate: not woken by each alert put meanwhile (each wake-up
                # would take the GIL from the supervision loop).
                self._closing.wait(until - now)
                continue
            try:
                item = self._queue.get(timeout=until - now)
            except queue.Empty:
                continue
            if item is _STOP:
                return batch, True
            batch.append(item)

    def _drain(self, batch: list[Alert]) -> tuple[list[Alert], bool]:
        """`batch` with everything queued now; True when the stop was among it."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return batch, False
            if item is _STOP:
                return batch, True
            batch.append(item)

    def _deliver(self, batch: list[Alert]) -> None:
        dropped, self.dropped = self.dropped, 0
        body, headers = render(self.hook.format, batch, self.pod, dropped)
        facts = {"alert": batch[0].event if len(batch) == 1 else "summary",
                 "severity": worst(batch), "keys": [a.key for a in batch],
                 "webhook": self.hook.name, **({"dropped": dropped} if dropped else {})}
        tries = 0

        def send() -> int:
            nonlocal tries
            tries += 1
            self._sent_at.append(time.monotonic())
            return post(self.hook, body, headers, self.timeout_s)
        try:
            status = retrying(send, attempts(
                self.attempts, lambda exc: isinstance(exc, DeliveryError) and exc.retry,
                backoff=lambda failures: self.backoff_s * 2 ** (failures - 1)))
        except DeliveryError as exc:
            self._record("alert_failed", **facts, attempts=tries,
                         error=scrub(str(exc)).replace(self.hook.url, "<webhook URL>"))
            return
        self._record("alert_sent", **facts, attempts=tries, status=status,
                     delay_s=round(time.time() - min(a.ts for a in batch), 3))

    def _record(self, event: str, **fields) -> None:
        try:
            self.record(event, **fields)
        except Exception:           # a full disk: the alert went (or not) all the same
            pass
