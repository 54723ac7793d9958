"""The goodput ledger of a pod from its files (launcher/dashboard/goodput.py sweeps them):
logs/events.jsonl read whole (it is small), the workers' METRICS files read fast and, for a
process that asks again (the dashboard, `status --watch`), incrementally."""

from __future__ import annotations

import json
import re
import stat
import time
from pathlib import Path

from launcher.config.podconfig import PodConfig
from launcher.dashboard.goodput import LINE, Ledger, ledger_of, marks_of
from launcher.pod.events import read_events
from launcher.pod.lock import read_holder
from launcher.paths import metrics_path
from launcher.worker.process import MetricsTail

# A metrics line as the worker writes it (docs/WORKER.md): the two fields the ledger needs,
# read without parsing (half the CPU time of json.loads, docs/BENCHMARKS.md); any other
# line goes through JSON.
_METRICS_LINE = re.compile(rb'\{"type": "metrics", "ts": ([0-9.eE+-]+), "gpu": -?\d+, '
                           rb'"step": -?\d+, "next_token": (\d+)[,}]')


class MarksTail:
    """One METRICS file's marks, read incrementally (a new or truncated file: from 0)."""

    def __init__(self, path: Path):
        self.path = path
        self.marks: list[tuple] = []
        self.tail, self.identity = MetricsTail(path, from_end=False), None

    def read(self) -> list[tuple]:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return self.marks
        if not stat.S_ISREG(st.st_mode):     # a folder in its place: no lines to read
            return self.marks
        if (st.st_dev, st.st_ino) != self.identity or st.st_size < self.tail.offset:
            self.marks, self.identity = [], (st.st_dev, st.st_ino)     # a new or cut file
            self.tail = MetricsTail(self.path, from_end=False)
        others = []
        match = _METRICS_LINE.match
        for line in self.tail.read_lines():
            found = match(line)
            if found is not None:
                self.marks.append((float(found[1]), LINE, "m", int(found[2])))
            elif b'"metrics"' in line or b'"stall_s"' in line or b'"merge_' in line:
                try:
                    record = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    continue
                if isinstance(record, dict):
                    others.append(record)
        self.marks += marks_of(others)
        return self.marks


def read_marks(path: Path) -> list[tuple]:
    return MarksTail(path).read()


class LedgerSource:
    """A pod's ledger from its files; kept, it re-reads only appended metrics lines."""

    def __init__(self, pod_dir: Path):
        self.pod_dir = pod_dir
        self.tails: dict[int, MarksTail] = {}

    def ledger(self, now: float | None = None,
               price_per_gpu_hour: float | None = None) -> Ledger:
        events = read_events(self.pod_dir)
        gpus = {g for e in events if e.get("event") == "launch"
                for g in (e.get("gpus") or []) if isinstance(g, int)}
        for gpu in gpus - set(self.tails):
            self.tails[gpu] = MarksTail(self.pod_dir / metrics_path(gpu))
        lines = {gpu: self.tails[gpu].read() for gpu in sorted(gpus)}
        return ledger_of(events, lines, now, price_per_gpu_hour)


def pod_ledger(pod_dir: Path, now: float | None = None,
               price_per_gpu_hour: float | None = None) -> Ledger:
    return LedgerSource(pod_dir).ledger(now, price_per_gpu_hour)


def goodput_report(pod_dir: Path, config: PodConfig, source: LedgerSource | None = None) -> dict:
    """The ledger as a dict; a live launcher's session counts up to now."""
    now = time.time() if read_holder(pod_dir) is not None else None
    return (source or LedgerSource(pod_dir)).ledger(now, config.price_per_gpu_hour).to_dict()
