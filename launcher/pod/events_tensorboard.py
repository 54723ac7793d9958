"""The launcher's decisions as TensorBoard text entries (logs/tb/launcher), a mirror of
logs/events.jsonl (which stays the record), fed by EventLog as it writes; a `merge_round`
also as scalars (merge_scalars: merge/round, merge/adopted, merge/seconds, merge/quorum,
merge/gate_rise/gpu{g}).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from fractus.train.tensorboard import EventFile
from launcher.paths import TENSORBOARD_RUN


def _number(value) -> float | None:
    """A finite number of a record, else None (a record is data)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value):
        return None
    return float(value)


def _gate_rises(gate) -> dict[str, float]:
    """Per GPU the gate's loss rise on the merged weights ({"gpus": {g: {"rise": r}}},
    launcher/checks/merge_gate.py's record)."""
    gpus = gate.get("gpus") if isinstance(gate, dict) else None
    if not isinstance(gpus, dict):
        return {}
    rises = {str(g): _number(v.get("rise")) for g, v in gpus.items() if isinstance(v, dict)}
    return {g: r for g, r in rises.items() if r is not None and g.isdigit()}


def merge_scalars(record: dict) -> dict[str, float]:
    """A `merge_round` event's numbers by tag: the round, adopted 1/0, its seconds, the
    quorum's size, each GPU's gate rise where the gate recorded one."""
    values = {"merge/round": _number(record.get("round")),
              "merge/adopted": 1.0 if record.get("verdict") == "adopted" else 0.0,
              "merge/seconds": _number(record.get("seconds")),
              "merge/quorum": float(len(record["quorum"]))
              if isinstance(record.get("quorum"), list) else None}
    values.update({f"merge/gate_rise/gpu{g}": r
                   for g, r in _gate_rises(record.get("gate")).items()})
    return {tag: v for tag, v in values.items() if v is not None}


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
        from torch.utils.tensorboard.summary import scalar, text as text_summary
        fields = {k: v for k, v in record.items() if k not in ("ts", "event")}
        text = f"**{record['event']}** `{json.dumps(fields, default=str)}`"
        if self._file is None:
            self._file = EventFile(self._run_dir)
        self._file.write(Event(wall_time=record["ts"], step=int(record["ts"]),
                               summary=text_summary(f"events/{record['event']}", text)))
        if record["event"] == "merge_round":
            for tag, value in merge_scalars(record).items():
                self._file.write(Event(wall_time=record["ts"], step=int(record["ts"]),
                                       summary=scalar(tag, value)))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
