"""The launcher's decisions as TensorBoard text entries (logs/tb/launcher), beside the GPUs'
scalar runs (logs/tb/gpu{i}, written by the workers): `tensorboard --logdir logs/tb` then
shows when a restart, rollback, stage switch, verdict or hub push happened.

logs/events.jsonl stays the record; this is a mirror of it, fed by EventLog as it writes.
"""

from __future__ import annotations

import json
from pathlib import Path

from launcher.paths import TENSORBOARD_RUN  # noqa: F401 (re-exported)

FLUSH_SECS = 5


class EventsToTensorBoard:
    """Called with each event record EventLog writes; the step is the event's second (a
    launcher-wide clock that never goes back across launches, unlike a counter)."""

    def __init__(self, pod_dir: Path):
        from torch.utils.tensorboard import SummaryWriter
        self._writer = SummaryWriter(log_dir=str(pod_dir / TENSORBOARD_RUN),
                                     flush_secs=FLUSH_SECS)

    def __call__(self, record: dict) -> None:
        fields = {k: v for k, v in record.items() if k not in ("ts", "event")}
        # Markdown: the event name in bold, its fields as inline code.
        text = f"**{record['event']}** `{json.dumps(fields, default=str)}`"
        self._writer.add_text(f"events/{record['event']}", text, int(record["ts"]),
                              walltime=record["ts"])

    def close(self) -> None:
        self._writer.close()
