"""Progress of the long operations (hashing, merge, hub push/pull, probes, canary).

On a terminal: a rich bar on stderr. Elsewhere: lines on stdout after PLAIN_FIRST_S, then at
most every PLAIN_EVERY_S (a quick operation prints nothing, a slow one is never silent). Off
the main thread (the background hub sync) nothing: those report through events.
"""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager
from typing import Iterator

PLAIN_FIRST_S = 5.0
PLAIN_EVERY_S = 15.0


def _amount(value: float, unit: str) -> str:
    if unit == "bytes":
        return f"{value / 1e9:.2f} GB" if value >= 1e8 else f"{value / 1e6:.1f} MB"
    return f"{value:g}"


class Task:
    """What a site updates: completed/total in `unit` ("bytes" prints as MB/GB), description."""

    def __init__(self, description: str, total: float | None, unit: str):
        self.description, self.total, self.unit = description, total, unit
        self.completed = 0.0
        self._lock = threading.Lock()     # hashing threads advance one task together

    def update(self, *, advance: float = 0.0, completed: float | None = None,
               description: str | None = None, total: float | None = None) -> None:
        with self._lock:
            if completed is not None:
                self.completed = completed
            self.completed += advance
            if description is not None:
                self.description = description
            if total is not None:
                self.total = total
        self._show()

    def advance(self, amount: float) -> None:
        """A callback for loops that only count (sha256_file's bytes)."""
        self.update(advance=amount)

    def _show(self) -> None:
        pass

    def line(self) -> str:
        done = _amount(self.completed, self.unit)
        if not self.total:
            return f"{self.description}: {done}" if self.completed else self.description
        percent = 100.0 * self.completed / self.total
        unit = "" if self.unit in ("bytes", "") else f" {self.unit}"
        return (f"{self.description}: {done}/{_amount(self.total, self.unit)}{unit} "
                f"({percent:.0f}%)")


class _PlainTask(Task):
    """Lines on stdout; a ticker keeps them coming through a step it cannot measure."""

    def __init__(self, description: str, total: float | None, unit: str):
        super().__init__(description, total, unit)
        self.started = time.monotonic()
        self.printed_at: float | None = None
        self._closed = threading.Event()
        threading.Thread(target=self._tick, daemon=True, name="progress").start()

    def _tick(self) -> None:
        while not self._closed.wait(1.0):
            self._show()

    def close(self) -> None:
        self._closed.set()
        self._show(closing=True)

    def _show(self, closing: bool = False) -> None:
        with self._lock:
            self._print_if_due(closing)

    def _print_if_due(self, closing: bool) -> None:
        now = time.monotonic()
        elapsed = now - self.started
        if closing:
            if self.printed_at is not None:
                print(f"{self.line()}, done in {elapsed:.0f}s", file=sys.stdout, flush=True)
            return
        due = (self.printed_at is None and elapsed >= PLAIN_FIRST_S) or (
            self.printed_at is not None and now - self.printed_at >= PLAIN_EVERY_S)
        if due:
            self.printed_at = now
            print(f"{self.line()}, {elapsed:.0f}s", file=sys.stdout, flush=True)


class _RichTask(Task):
    def __init__(self, description: str, total: float | None, unit: str, bar):
        super().__init__(description, total, unit)
        self._bar = bar
        self._id = bar.add_task(description, total=total)

    def _show(self) -> None:
        self._bar.update(self._id, completed=self.completed, total=self.total,
                         description=self.description)


def _rich_bar(unit: str):
    # rich.progress (~90 ms) only where a bar is drawn: a terminal, not a daemon or a test
    from rich.console import Console
    from rich.progress import (BarColumn, DownloadColumn, MofNCompleteColumn, Progress,
                               SpinnerColumn, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)
    amount = DownloadColumn() if unit == "bytes" else MofNCompleteColumn()
    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), amount,
                    TimeElapsedColumn(), TimeRemainingColumn(),
                    console=Console(stderr=True))


@contextmanager
def progress(description: str, total: float | None = None, unit: str = "") -> Iterator[Task]:
    """`with progress("hashing checkpoints", total=n_bytes, unit="bytes") as task: ...`"""
    if threading.current_thread() is not threading.main_thread():
        yield Task(description, total, unit)          # counts, shows nothing
        return
    if sys.stderr.isatty():
        with _rich_bar(unit) as bar:
            yield _RichTask(description, total, unit, bar)
        return
    task = _PlainTask(description, total, unit)
    try:
        yield task
    finally:
        task.close()
