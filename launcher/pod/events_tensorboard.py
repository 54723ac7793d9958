"""The launcher's decisions as TensorBoard text entries (logs/tb/launcher), a mirror of
logs/events.jsonl (which stays the record), fed by EventLog as it writes.
"""

from __future__ import annotations

import json
from pathlib import Path

from fractus.train.tensorboard import EventFile
from launcher.paths import TENSORBOARD_RUN


class EventsToTensorBoard:
    """The step is the event's second (never goes back across launches, unlike a counter).
    Written on the caller's thread, so a full disk raises in the launcher's own write."""

    def __init__(self, pod_dir: Path):
        self._run_dir = pod_dir / TENSORBOARD_RUN
        # Opened at the first event: a refused launch leaves no empty event file behind.
        self._file: EventFile | None = None

    def __call__(self, record: dict) -> None:
        # torch (~2 s), paid at the first event: a refused launch records none
        from tensorboard.compat.proto.event_pb2 import Event
        from torch.utils.tensorboard.summary import text as text_summary
        fields = {k: v for k, v in record.items() if k not in ("ts", "event")}
        text = f"**{record['event']}** `{json.dumps(fields, default=str)}`"
        if self._file is None:
            self._file = EventFile(self._run_dir)
        self._file.write(Event(wall_time=record["ts"], step=int(record["ts"]),
                               summary=text_summary(f"events/{record['event']}", text)))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
