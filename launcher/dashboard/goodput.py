"""The goodput ledger: how much of the paid GPU time trained, and what each incident cost.
Pure: one sweep over time per GPU of the records the pod already writes (events and
METRICS lines). Every second of a launcher session goes to exactly one bucket (CAUSES, or
trained), so trained + lost = wall time per GPU by construction. Computed on demand, never
written: the records are the one source of truth, a ledger file could only lag them.
Buckets and costs: docs/LAUNCHER.md "Goodput: where the paid GPU time went".
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from operator import itemgetter
from pathlib import Path

CAUSES = ("startup", "load", "retrain_rollback", "retrain_crash", "crash", "hang", "canary",
          "node_wait", "checkpoint_stall", "merge_round", "stopped", "final_probes",
          "final_push")
CAUSE_TEXT = {"startup": "start-up checks", "load": "restart and model load",
              "retrain_rollback": "re-training after a rollback",
              "retrain_crash": "re-training after a crash", "crash": "lost in a crash",
              "hang": "hang until detected", "canary": "stage canary",
              "node_wait": "waiting for a node", "checkpoint_stall": "checkpoint stall",
              "merge_round": "waiting in merge rounds",
              "stopped": "stopped", "final_probes": "final probes",
              "final_push": "final push and exit"}
# Events that end a launcher session (the pod's workers are no longer supervised).
SESSION_ENDS = ("pod_done", "pod_stopped", "pod_failed", "launch_stopped")

# The sweep's states of one GPU, each with the bucket its time goes to.
_OUT, _LOAD, _TRAIN, _BACKOFF, _NODE_WAIT, _STOPPED = \
    "out", "load", "train", "backoff", "node_wait", "stopped"


@dataclass
class GpuLedger:
    gpu: int
    wall_s: float = 0.0
    trained_s: float = 0.0
    lost_s: dict = field(default_factory=lambda: {c: 0.0 for c in CAUSES})
    tokens_trained: int = 0          # new tokens: each counted once
    tokens_retrained: int = 0        # trained again after a rollback or a crash

    @property
    def lost_total_s(self) -> float:
        return sum(self.lost_s.values())

    def to_dict(self) -> dict:
        return {"gpu": self.gpu, "wall_s": round(self.wall_s, 3),
                "trained_s": round(self.trained_s, 3),
                "lost_s": {c: round(s, 3) for c, s in self.lost_s.items()},
                "goodput": _ratio(self.trained_s, self.wall_s),
                "tokens_trained": self.tokens_trained,
                "tokens_retrained": self.tokens_retrained}


@dataclass
class Ledger:
    wall_s: float                    # the pod's: the launcher sessions, canaries included
    gpus: dict[int, GpuLedger]
    sessions: int
    price_per_gpu_hour: float | None = None

    @property
    def gpu_seconds(self) -> float:
        return sum(g.wall_s for g in self.gpus.values())

    @property
    def trained_s(self) -> float:
        return sum(g.trained_s for g in self.gpus.values())

    def lost_s(self) -> dict[str, float]:
        return {c: sum(g.lost_s[c] for g in self.gpus.values()) for c in CAUSES}

    @property
    def goodput(self) -> float | None:
        return _ratio(self.trained_s, self.gpu_seconds)

    def money(self, seconds: float) -> float | None:
        if self.price_per_gpu_hour is None:
            return None
        return round(seconds / 3600.0 * self.price_per_gpu_hour, 2)

    def to_dict(self) -> dict:
        lost = self.lost_s()
        return {"wall_s": round(self.wall_s, 3), "sessions": self.sessions,
                "gpu_hours": round(self.gpu_seconds / 3600.0, 4),
                "trained_gpu_hours": round(self.trained_s / 3600.0, 4),
                "goodput": self.goodput,
                "lost_s": {c: round(s, 3) for c, s in lost.items()},
                "tokens_trained": sum(g.tokens_trained for g in self.gpus.values()),
                "tokens_retrained": sum(g.tokens_retrained for g in self.gpus.values()),
                "price_per_gpu_hour": self.price_per_gpu_hour,
                "cost": self.money(self.gpu_seconds),
                "lost_cost": {c: self.money(s) for c, s in lost.items()}
                if self.price_per_gpu_hour is not None else None,
                "gpus": {str(g): led.to_dict() for g, led in sorted(self.gpus.items())},
                "cause_text": CAUSE_TEXT}


def goodput_line(ledger: dict) -> str:
    """`status`'s line of a Ledger.to_dict(): goodput, GPU-hours, money, the 3 worst losses."""
    if not ledger["gpus"]:
        return "goodput: no launch recorded yet"
    lost = sorted(((s, c) for c, s in ledger["lost_s"].items() if s > 0), reverse=True)
    worst = ", ".join(f"{CAUSE_TEXT[c]} {hours(s)}" for s, c in lost[:3])
    return (f"goodput {pct(ledger['goodput'])} of {ledger['gpu_hours']:.2f} GPU-h"
            + (f" ({ledger['cost']:,.2f} paid)" if ledger["cost"] is not None else "")
            + (f"; lost: {worst}" if worst else "; nothing lost"))


def _ratio(part: float, whole: float) -> float | None:
    return round(part / whole, 4) if whole > 0 else None


def pct(ratio: float | None) -> str:
    return "-" if ratio is None else f"{100 * ratio:.1f}%"


def duration(seconds: float, of: str = "") -> str:
    """`of` "GPU-": GPU time summed over GPUs."""
    return f"{seconds / 3600:.2f} {of}h" if seconds >= 360 else f"{seconds:.0f} {of}s"


def hours(seconds: float) -> str:
    return duration(seconds, "GPU-")


@dataclass
class _Session:
    start: float
    gpus: list[int]
    canary_s: float                  # the canaries just before it (the pod waited on them)
    end: float | None = None         # None: still open (a live launcher, or one that died)
    last_event: float = 0.0
    startup_s: float = 0.0           # the launcher's checks before its `launch` event
    final_probes_s: float = 0.0      # after its end event, until `launch_end`: the probes
    final_push_s: float = 0.0        # ... and the rest (the final push, closing)


def _sessions(events: list[dict]) -> list[_Session]:
    """The launcher sessions: each `launch` to its end event, or to the next launch."""
    sessions: list[_Session] = []
    canary_s = 0.0
    for e in events:
        name, ts = e.get("event"), e["ts"]
        current = sessions[-1] if sessions and sessions[-1].end is None else None
        if name == "launch":
            gpus = [g for g in e.get("gpus") or [] if isinstance(g, int)]
            startup = e.get("startup_s")
            sessions.append(_Session(ts, gpus, canary_s, last_event=ts,
                                     startup_s=_seconds(startup)))
            canary_s = 0.0
        elif name == "launch_end" and current is None and sessions \
                and sessions[-1].end is not None and not sessions[-1].final_push_s \
                and ts >= sessions[-1].end:
            ending = ts - sessions[-1].end
            probes = min(_seconds(e.get("final_probes_s")), ending)
            sessions[-1].final_probes_s, sessions[-1].final_push_s = probes, ending - probes
        elif current is None:
            seconds = e.get("seconds")
            if name == "canary" and isinstance(seconds, (int, float)) and seconds > 0:
                canary_s += float(seconds)
        elif name in SESSION_ENDS:
            current.end = ts
        else:
            current.last_event = ts
    return sessions


def _seconds(value) -> float:
    """A recorded duration, or 0 for anything that is not one (a record is data)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value < 0:
        return 0.0
    return float(value)


def _close_open_sessions(sessions: list[_Session], last_line: dict[int, list[float]],
                         now: float | None) -> None:
    """An end for each session without one: `now` for a live last one, else its last record."""
    for i, session in enumerate(sessions):
        if session.end is not None:
            continue
        if now is not None and i == len(sessions) - 1:
            session.end = max(now, session.last_event)
            continue
        limit = sessions[i + 1].start if i + 1 < len(sessions) else math.inf
        ends = [session.last_event]
        for gpu in session.gpus:
            times = last_line.get(gpu, [])
            k = bisect.bisect_left(times, limit)
            if k and times[k - 1] >= session.start:
                ends.append(times[k - 1])
        session.end = max(ends)


# Ordering of records at the same instant (LINE: also the files' reader): a session opens first and closes last.
_OPEN, _EVENT, LINE, _CLOSE = 0, 1, 2, 3


def compute_ledger(events: list[dict], metrics: dict[int, list[dict]],
                   now: float | None = None,
                   price_per_gpu_hour: float | None = None) -> Ledger:
    """`metrics`: GPU -> its METRICS records. `now`: where a live last session ends (None:
    at its last record, as for a launcher that died)."""
    return ledger_of(events, {gpu: marks_of(records) for gpu, records in metrics.items()}, now,
                   price_per_gpu_hour)


def marks_of(records: list[dict]) -> list[tuple]:
    """A GPU's METRICS records as (ts, order, kind, value) marks: ("m", next_token) per
    metrics line, ("stall", seconds) per checkpoint save, ("wait", None) per merge round's
    `merge_wait`, ("waited", seconds) per `merge_adopted`/`merge_skipped` (its waited_s)."""
    marks = [(r["ts"], LINE, "m", r["next_token"]) for r in records
             if r.get("type") == "metrics" and isinstance(r.get("ts"), (int, float))
             and isinstance(r.get("next_token"), int)]
    marks += [(r["ts"], LINE, "stall", float(r["stall_s"])) for r in records
              if r.get("event") == "checkpoint" and isinstance(r.get("ts"), (int, float))
              and isinstance(r.get("stall_s"), (int, float)) and r["stall_s"] > 0]
    marks += [(r["ts"], LINE, "wait", None) if r["event"] == "merge_wait"
              else (r["ts"], LINE, "waited", _seconds(r.get("waited_s"))) for r in records
              if r.get("event") in ("merge_wait", "merge_adopted", "merge_skipped")
              and isinstance(r.get("ts"), (int, float))]
    return marks


def _in_round(since: float, ts: float, waited_s: float, wait_from: float | None) -> float:
    """Of the span [since, ts], the seconds a GPU waited in a merge round: the waits that
    ended in it (`waited_s`), and one still open since `wait_from` (cut short at `ts`)."""
    span = ts - since if ts > since else 0.0
    if wait_from is not None:
        waited_s += ts - (wait_from if wait_from > since else since)
    return waited_s if waited_s < span else span


def ledger_of(events: list[dict], lines: dict[int, list[tuple]], now: float | None,
            price_per_gpu_hour: float | None) -> Ledger:
    events = sorted((e for e in events if isinstance(e.get("ts"), (int, float))),
                    key=itemgetter("ts"))
    sessions = _sessions(events)
    _close_open_sessions(sessions, {g: sorted(t[0] for t in recs if t[2] == "m")
                                    for g, recs in lines.items()}, now)
    streams: dict[int, list[tuple]] = {}
    for session in sessions:
        for gpu in session.gpus:
            streams.setdefault(gpu, []).extend(
                [(session.start, _OPEN, "open", (session.startup_s, session.canary_s)),
                 (session.end, _CLOSE, "close",
                  (session.final_probes_s, session.final_push_s))])
    for e in events:
        gpu = e.get("gpu")
        if isinstance(gpu, int) and gpu in streams:
            streams[gpu].append((e["ts"], _EVENT, e.get("event"), e))
    ledgers = {}
    for gpu, stream in streams.items():
        stream.extend(lines.get(gpu, ()))
        stream.sort(key=itemgetter(0, 1))
        ledgers[gpu] = _sweep(gpu, stream)
    wall = sum(s.end - s.start + s.startup_s + s.canary_s + s.final_probes_s
               + s.final_push_s for s in sessions)
    return Ledger(wall_s=wall, gpus=ledgers, sessions=len(sessions),
                  price_per_gpu_hour=price_per_gpu_hour)


def _sweep(gpu: int, stream: list[tuple]) -> GpuLedger:
    """Each span [since, ts] of one GPU's records to its state's bucket (backoff: load)."""
    led = GpuLedger(gpu)
    lost = led.lost_s
    state, since = _OUT, 0.0
    high_water = token = 0           # the furthest token any line reached; the run's token
    retrain_cause = "retrain_crash"
    stall_s = 0.0                    # a save's stall to take out of the next training span
    waited_s, wait_from = 0.0, None  # a merge round's wait in this span; one not ended yet
    failing = False                  # its checks failed: a kill now is the rollback's
    idle_bucket = {_LOAD: "load", _BACKOFF: "load", _NODE_WAIT: "node_wait",
                   _STOPPED: "stopped", _TRAIN: "stopped"}
    for ts, _, kind, value in stream:
        if kind == "m":
            if state in (_TRAIN, _LOAD):     # a round's wait first, out of either
                in_round = _in_round(since, ts, waited_s, wait_from)
                lost["merge_round"] += in_round
                led.wall_s += in_round
                since, waited_s, wait_from = since + in_round, 0.0, None
            if state == _TRAIN:      # a span between two lines: trained, or trained again
                span = ts - since if ts > since else 0.0
                stall = stall_s if stall_s < span else span
                stall_s -= stall
                work = span - stall
                done = value - token
                again = (value if value < high_water else high_water) - token
                retrain = work * again / done if done > 0 and again > 0 else 0.0
                if retrain > work:
                    retrain = work
                lost["checkpoint_stall"] += stall
                lost[retrain_cause] += retrain
                led.trained_s += work - retrain
                led.wall_s += span
                since = ts
            elif state == _LOAD:     # the run's first line: its load is over
                span = ts - since if ts > since else 0.0
                lost["load"] += span
                led.wall_s += span
                since, state = ts, _TRAIN
            else:
                continue             # a line outside a session, or after its worker ended
            # Tokens count from where the run started (its first line's step included).
            top = token if token > high_water else high_water
            if value > top:
                led.tokens_trained += value - top
            again = (value if value < high_water else high_water) - token
            if again > 0:
                led.tokens_retrained += again
            token = value
            if value > high_water:
                high_water = value
            continue
        if kind == "stall":
            stall_s += value
            continue
        if kind in ("wait", "waited"):
            if state in (_TRAIN, _LOAD):     # (a record outside a run: no wait of its)
                if kind == "wait":
                    wait_from = ts
                else:               # the wait ended here: its part in this span
                    waited_s += value if value < ts - since else max(ts - since, 0.0)
                    wait_from = None
            continue
        # A change of state: book the span so far (to `cause`, else the state's own bucket).
        cause, new_state = None, None
        if kind == "open":          # the launcher's start-up checks and its canary
            lost["startup"] += value[0]
            lost["canary"] += value[1]
            led.wall_s += value[0] + value[1]
            since, state = ts, _LOAD
            continue
        if kind == "close":         # then its final probes and push, after the end event
            lost["final_probes"] += value[0]
            lost["final_push"] += value[1]
            led.wall_s += value[0] + value[1]
            cause, new_state = ("stopped" if state in (_BACKOFF, _TRAIN) else None), _OUT
        elif kind == "worker_start":
            new_state, failing = _LOAD, False
            start = value.get("start_token")
        elif kind == "hang":
            cause, new_state = ("hang" if state == _TRAIN else None), _BACKOFF
            retrain_cause = "retrain_crash"
        elif kind == "check_failed":
            failing = True
        elif kind == "worker_exit":
            crashed = value.get("code") not in (0, None)
            # A GPU killed for its rollback loses its work since the last line to it.
            if state == _TRAIN:
                cause = "retrain_rollback" if failing else "crash" if crashed else "stopped"
            new_state = _BACKOFF if crashed else _STOPPED
            if crashed and not failing:
                retrain_cause = "retrain_crash"
        elif kind == "rollback":
            cause = "retrain_rollback" if state == _TRAIN else None
            new_state, retrain_cause = _BACKOFF, "retrain_rollback"
        elif kind in ("node_lost", "gpu_waiting"):
            new_state, retrain_cause = _NODE_WAIT, "retrain_crash"
        if new_state is None or state == _OUT:
            continue                 # no change, or an event outside a session
        span = ts - since if ts > since else 0.0
        in_round = _in_round(since, ts, waited_s, wait_from) if state in (_TRAIN, _LOAD) \
            else 0.0                 # a wait cut short by this change: a round's until it
        waited_s, wait_from = 0.0, None
        lost["merge_round"] += in_round
        lost[cause or idle_bucket[state]] += span - in_round
        led.wall_s += span
        since, state = ts, new_state
        if kind == "worker_start":
            token = start if isinstance(start, int) else 0
    return led
