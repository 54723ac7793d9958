"""The worker's metrics as TensorBoard scalars (TB_DIR), beside the JSON lines.

For people only (the launcher reads METRICS alone). Written on the caller's thread, not by
torch's SummaryWriter, whose writer thread dies on a full disk outside the worker's
disk-full exit; here a failed write raises where the worker handles it.
"""

from __future__ import annotations

import math
import os
import socket
import time
from pathlib import Path

# Metrics-line field -> TensorBoard tag (grouped as TensorBoard shows them).
SCALAR_TAGS = {
    "tf": "loss/tf", "ema_tf": "loss/ema_tf", "ss": "loss/ss", "ema_ss": "loss/ema_ss",
    "lb": "lb", "grad_norm": "grad_norm", "tok_s": "tok_s", "mem_gb": "mem_gb",
}
STAGE_TAG = "stage"
FLUSH_SECS = 5      # a line reaches the file within this (TensorBoard polls its logdir)


class EventFile:
    """One event file in `run_dir`; `write` buffers (an OSError raises here), flushed every
    FLUSH_SECS and at close."""

    def __init__(self, run_dir: str | os.PathLike):
        # tensorboard's protobufs only when a worker writes TensorBoard
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.summary.writer.record_writer import RecordWriter
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        # The name TensorBoard looks for (and SummaryWriter writes): events.out.tfevents.*
        name = (f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}."
                f"{os.getpid()}.0")
        self._records = RecordWriter(open(Path(run_dir) / name, "ab"))
        self._flush_at = time.monotonic() + FLUSH_SECS
        self.write(Event(wall_time=time.time(), file_version="brain.Event:2"))

    def write(self, event) -> None:
        self._records.write(event.SerializeToString())
        if time.monotonic() >= self._flush_at:
            self._records.flush()
            self._flush_at = time.monotonic() + FLUSH_SECS

    def close(self) -> None:
        self._records.close()      # a file is closed even when its last flush fails


class TensorBoardScalars:
    """One run directory per worker; `metrics(record)` takes a METRICS metrics record."""

    def __init__(self, run_dir: str, stage: int | None):
        self._file = EventFile(run_dir)
        self._stage = stage

    def metrics(self, record: dict) -> None:
        # as in __init__
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        values = {tag: record.get(field) for field, tag in SCALAR_TAGS.items()}
        if self._stage is not None:
            values[STAGE_TAG] = self._stage
        summary = Summary(value=[Summary.Value(tag=tag, simple_value=value)
                                 for tag, value in values.items()
                                 if isinstance(value, (int, float)) and math.isfinite(value)])
        self._file.write(Event(wall_time=record["ts"], step=record["step"], summary=summary))

    def close(self) -> None:
        self._file.close()
