"""The pod's event log (logs/events.jsonl): one JSON object per line, appended whole through
EventLog (the launcher and the commands that act on the pod), never rewritten. Every decision
the launcher makes is recorded here.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from pathlib import Path

from launcher.paths import EVENTS_FILE


class Mirrors:
    """Several mirrors of one EventLog (the TensorBoard run, the alerts), called in order."""

    def __init__(self, *mirrors):
        self.mirrors = [m for m in mirrors if m is not None]

    def __call__(self, record: dict) -> None:
        # Each mirror sees the record even when one before it fails: a full disk failing the
        # TensorBoard write is exactly when the alert must still go out.
        error = None
        for mirror in self.mirrors:
            try:
                mirror(record)
            except Exception as exc:
                error = error or exc
        if error is not None:
            raise error

    def close(self) -> None:
        for mirror in self.mirrors:
            mirror.close()


class EventLog:
    """`mirror`, if given, is called with each record after it is written (a Mirrors)."""

    def __init__(self, pod_dir: Path, mirror=None):
        self.path = pod_dir / EVENTS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.mirror = mirror
        # Never-raising sinks (the tracker's), kept when `mirror` is replaced after --detach.
        self.taps: list = []

    def emit(self, event: str, **fields) -> dict:
        return self.emit_all([(event, fields)])[0]

    def emit_all(self, events: list[tuple[str, dict]]) -> list[dict]:
        """Several (name, fields) events recorded in order with one append and one fsync."""
        now = time.time()
        records = [{"ts": now, "event": event, **fields} for event, fields in events]
        data = "".join(json.dumps(record, default=str) + "\n" for record in records)
        # One write on an O_APPEND descriptor: never interleaved with another writer's line.
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        for record in records:
            for tap in self.taps:
                tap(record)
            if self.mirror is not None:
                self.mirror(record)
        return records


def read_events(pod_dir: Path, last: int | None = None) -> list[dict]:
    """The recorded events, oldest first (the newest `last` if given). Bad lines skipped."""
    path = pod_dir / EVENTS_FILE
    if not path.is_file():
        return []
    keep: deque = deque(maxlen=last)
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue     # a line being written right now
            if isinstance(record, dict):
                keep.append(record)
    return list(keep)
