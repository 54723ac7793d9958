"""Each GPU's curves from its METRICS file, read incrementally (a file that shrank is read
again from the start), downsampled for drawing.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np

from launcher.paths import metrics_path

CURVES = ("ema_tf", "lb", "tok_s")          # what the dashboard and the plot draw
METRICS_PREFIX = b'{"type": "metrics"'      # MetricsWriter's json.dumps puts "type" first
START_PREFIX = b'{"type": "event", "event": "start"'   # a worker (re)start: the curve breaks
METRICS_FILE = re.compile(r"metrics_gpu(\d+)\.jsonl$")


def metrics_files(pod_dir: Path) -> dict[int, Path]:
    found = {}
    for path in pod_dir.glob(metrics_path("*")):
        match = METRICS_FILE.search(path.name)
        if match:
            found[int(match.group(1))] = path
    return dict(sorted(found.items()))


def _number(value) -> float:
    return float(value) if isinstance(value, (int, float)) else math.nan   # null -> gap


class GpuSeries:
    """One GPU's metrics lines as columns: ts, step, next_token, *CURVES (null: NaN); a
    worker start is a row with only ts and next_token."""

    def __init__(self, path: Path):
        self.path = path
        self._offset = 0
        self._chunks: list[np.ndarray] = []
        self._columns: np.ndarray | None = None     # rows: ts, step, next_token, *CURVES

    def refresh(self) -> bool:
        """Read what was appended; True if new metrics lines came."""
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return False
        if size < self._offset:                     # rewritten: start over
            self._offset, self._chunks, self._columns = 0, [], None
        if size == self._offset:
            return False
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            data = f.read(size - self._offset)
        end = data.rfind(b"\n") + 1                 # a line still being written waits
        self._offset += end
        lines = [line for line in data[:end].split(b"\n")
                 if line.startswith(METRICS_PREFIX) or line.startswith(START_PREFIX)]
        if not lines:
            return False
        # One json.loads for the whole batch: the C parser, not a Python call per line.
        records = json.loads(b"[" + b",".join(lines) + b"]")
        # A start event is a row of NaN at its time: no line drawn across a restart's gap
        # (its next_token says where the run starts: the tokens each run trained).
        nan_row = [math.nan] * len(CURVES)
        rows = np.array([[_number(r.get("ts"))]
                         + ([_number(r.get("step")), _number(r.get("next_token"))]
                            + [_number(r.get(name)) for name in CURVES]
                            if r.get("type") == "metrics"
                            else [math.nan, _number(r.get("next_token"))] + nan_row)
                         for r in records], dtype=np.float64)
        self._chunks.append(rows.T)
        self._columns = None
        return True

    @property
    def columns(self) -> np.ndarray:
        if self._columns is None:
            self._columns = (np.concatenate(self._chunks, axis=1) if self._chunks
                             else np.empty((3 + len(CURVES), 0)))
            self._chunks = [self._columns]
        return self._columns

    def __len__(self) -> int:
        return self.columns.shape[1]

    @property
    def metrics_lines(self) -> int:
        return int(np.count_nonzero(~np.isnan(self.columns[1])))   # start rows have no step

    @property
    def newest_ts(self) -> float | None:
        return float(self.columns[0, -1]) if len(self) else None

    def trained(self) -> tuple[np.ndarray, np.ndarray]:
        """(ts, tokens trained so far) per row, over all runs; only grows."""
        cols = self.columns
        starts = np.isnan(cols[1])
        token = cols[2]
        previous = np.concatenate([[np.nan], token[:-1]])
        step = np.where(starts | np.isnan(previous) | np.isnan(token), 0.0, token - previous)
        return cols[0], np.cumsum(np.maximum(step, 0.0))

    def curve(self, name: str, max_points: int) -> tuple[np.ndarray, np.ndarray]:
        cols = self.columns
        restarts = np.flatnonzero(np.isnan(cols[1]))
        return downsample(cols[0], cols[3 + CURVES.index(name)], max_points, keep=restarts)


def downsample(x: np.ndarray, y: np.ndarray, max_points: int,
               keep: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Min-max decimation into max_points // 2 buckets, so a spike survives; the last point
    and the rows in `keep` (restart gaps) are always kept."""
    n = len(x)
    if n <= max_points:
        return x, y
    buckets = max(1, max_points // 2)
    size = math.ceil(n / buckets)
    pad = buckets * size - n
    ys = np.concatenate([y, np.full(pad, np.nan)]).reshape(buckets, size)
    valid = ~np.isnan(ys)
    low = np.where(valid, ys, np.inf).argmin(axis=1)
    high = np.where(valid, ys, -np.inf).argmax(axis=1)
    first, second = np.minimum(low, high), np.maximum(low, high)
    base = np.arange(buckets) * size
    index = np.stack([base + first, base + second], axis=1).ravel()
    index = np.unique(np.concatenate([np.minimum(index, n - 1), [n - 1],
                                      keep if keep is not None else []]).astype(np.int64))
    return x[index], y[index]


class PodSeries:

    def __init__(self, pod_dir: Path):
        self.pod_dir = pod_dir
        self.gpus: dict[int, GpuSeries] = {}

    def refresh(self) -> None:
        for gpu, path in metrics_files(self.pod_dir).items():
            self.gpus.setdefault(gpu, GpuSeries(path)).refresh()

    @property
    def metrics_lines(self) -> int:
        return sum(s.metrics_lines for s in self.gpus.values())

    @property
    def newest_ts(self) -> float | None:
        return max((s.newest_ts for s in self.gpus.values() if len(s)), default=None)

    def curves(self, max_points: int) -> dict[str, dict[int, tuple[np.ndarray, np.ndarray]]]:
        """curve name -> GPU -> (ts, values), each downsampled to about max_points."""
        return {name: {gpu: series.curve(name, max_points) for gpu, series in self.gpus.items()}
                for name in CURVES}
