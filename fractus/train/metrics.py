"""Structured worker output: JSON lines for supervisors, the v1 human line for people.

Each METRICS line is one JSON object, "type" "metrics" or "event" (docs/WORKER.md,
"Output"), flushed as written; non-finite floats become null (strict JSON).
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from pathlib import Path

from fractus.train.disk import no_space_error

METRIC_FIELDS = ("step", "next_token", "tf", "ema_tf", "ss", "ema_ss", "lb", "grad_norm",
                 "tok_s", "mem_gb")


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


class MetricsWriter:
    """Appends JSON lines to `path` (None: no file); every metrics record also goes to
    `tensorboard` (TensorBoardScalars) if given."""

    def __init__(self, path: str | os.PathLike | None, gpu: int, tensorboard=None):
        self.gpu = gpu
        self._tensorboard = tensorboard
        self._file = None
        self._lock = threading.Lock()   # the checkpoint writer thread emits events too
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", buffering=1, encoding="utf-8")

    def _write(self, record: dict) -> None:
        line = json.dumps(_clean(record), allow_nan=False) + "\n"
        with self._lock:
            if self._file is None:
                return
            self._file.write(line)
            self._file.flush()

    def event(self, name: str, **fields) -> None:
        self._write({"type": "event", "event": name, "ts": time.time(), "gpu": self.gpu,
                     **fields})

    def metrics(self, **fields) -> None:
        missing = set(METRIC_FIELDS) - set(fields)
        if missing:
            raise ValueError(f"metrics line lacks {sorted(missing)}")
        record = {"type": "metrics", "ts": time.time(), "gpu": self.gpu,
                  **{k: fields[k] for k in METRIC_FIELDS}}
        self._write(record)
        if self._tensorboard is not None:
            self._tensorboard.metrics(record)

    def close(self) -> None:
        """Close both; on a full disk the last lines are lost, never turned into a crash."""
        tensorboard, self._tensorboard = self._tensorboard, None
        with self._lock:
            file, self._file = self._file, None
        for output in (tensorboard, file):
            if output is None:
                continue
            try:
                output.close()      # a file is closed even when its last flush fails
            except OSError as exc:
                if no_space_error(exc) is None:
                    raise


def human_line(gpu: int, next_token: int, tf: float, ema_tf: float, ss: float | None,
               ema_ss: float | None, lb: float, tok_s: float, mem_gb: float) -> str:
    """The v1 log line, unchanged (the user's log readers key on its `[boost]` tag)."""
    extra = f" ss={ss:.3f} ema_ss={ema_ss:.3f}" if ss is not None and ema_ss is not None else ""
    return (f"GPU {gpu}: {next_token:>12,} tf={tf:.3f} ema_tf={ema_tf:.3f}{extra} "
            f"lb={lb:.3f} {tok_s:.0f} tok/s mem={mem_gb:.1f}GB [boost]")
