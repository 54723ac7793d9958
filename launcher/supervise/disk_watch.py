"""Free space on the pod's and its checkpoints' disks: `disk_low` once below `disk_low_gib`
(before a save fails), `disk_ok` once back above 110 % of it (a hovering disk is said once)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from launcher.pod.events import EventLog

CHECK_EVERY_S = 10.0      # a save takes far longer than this to fill a disk's last GiBs
GIB = 1 << 30
RECOVERED_ABOVE = 1.1     # of the threshold


class DiskWatch:
    def __init__(self, paths: list[Path], threshold_gib: float, events: EventLog, clock):
        self.paths = _one_per_disk(paths)
        self.threshold = threshold_gib * GIB
        self.events, self.clock = events, clock
        self.low: set[Path] = set()
        self.next_at: float | None = None

    def check(self) -> None:
        now = self.clock()
        if self.threshold <= 0 or (self.next_at is not None and now < self.next_at):
            return
        self.next_at = now + CHECK_EVERY_S
        for path in self.paths:
            try:
                free = shutil.disk_usage(path).free
            except OSError:            # gone: the loop's own checks say so
                continue
            facts = {"path": str(path), "free_gib": round(free / GIB, 2),
                     "threshold_gib": round(self.threshold / GIB, 2)}
            if path not in self.low and free < self.threshold:
                self.low.add(path)
                self.events.emit("disk_low", **facts)
            elif path in self.low and free > self.threshold * RECOVERED_ABOVE:
                self.low.discard(path)
                self.events.emit("disk_ok", **facts)


def _one_per_disk(paths: list[Path]) -> list[Path]:
    """`paths` (or their nearest existing parent), one per file system."""
    seen, out = set(), []
    for path in paths:
        while not path.exists() and path != path.parent:
            path = path.parent
        try:
            device = os.stat(path).st_dev
        except OSError:
            continue
        if device not in seen:
            seen.add(device)
            out.append(path)
    return out
