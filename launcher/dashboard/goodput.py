"""The goodput ledger: how much of the paid GPU time trained, and what each incident cost.

A pure function over the records the pod already writes (logs/events.jsonl and each
worker's METRICS lines): one sweep over time per GPU. Every second of a launcher session
(`launch` to its end) goes to exactly one bucket, so trained + lost = wall time per GPU by
construction; the buckets are:

  trained           between two metrics lines of a run, on tokens never trained before
  load              restart and model load: launch or worker start (or a crash's backoff,
                    a rollback's restart) until the run's first metrics line
  retrain_rollback  training again tokens a rolled-back run had already trained
  retrain_crash     training again tokens a crashed (or hung) run had already trained
  crash             from the last metrics line to a worker's crash (work since it is lost)
  hang              from the last metrics line until the hang was detected
  canary            the stage canary before a launch (the whole pod waits on it)
  node_wait         waiting for a node (Ray) after a node was lost
  checkpoint_stall  the training thread stalled by a checkpoint save (`stall_s`)
  stopped           the GPU not running while the session lasts (finished early, given up,
                    the ending of a stop)

Computed on demand (status, the dashboard, `report`), not written by the launcher: the
events and metrics files are the one source of truth, a ledger file could only lag them,
and the supervision loop stays free of it (1000 events in a few ms: docs/BENCHMARKS.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from launcher.pod.events import read_events
from launcher.worker.process import metrics_path, read_records

CAUSES = ("load", "retrain_rollback", "retrain_crash", "crash", "hang", "canary",
          "node_wait", "checkpoint_stall", "stopped")
CAUSE_TEXT = {"load": "restart and model load", "retrain_rollback": "re-training after a rollback",
              "retrain_crash": "re-training after a crash", "crash": "lost in a crash",
              "hang": "hang until detected", "canary": "stage canary",
              "node_wait": "waiting for a node", "checkpoint_stall": "checkpoint stall",
              "stopped": "stopped"}
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
                "gpus": {str(g): led.to_dict() for g, led in sorted(self.gpus.items())}}


def goodput_line(ledger: dict) -> str:
    """One line of a ledger (Ledger.to_dict()), for `status`: goodput, GPU-hours, money, the
    three biggest losses."""
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


class _GpuSweep:
    """One GPU's state through the merged, time-ordered records."""

    def __init__(self, gpu: int):
        self.led = GpuLedger(gpu)
        self.state, self.since = _OUT, 0.0
        self.high_water = 0          # the furthest token any metrics line reached
        self.token = 0               # where the running worker is
        self.retrain_cause = "retrain_crash"
        self.stall_s = 0.0           # checkpoint stall to take out of the next training span
        self.failing = False         # its checks failed: a kill now is the rollback's

    def close(self, ts: float, cause: str | None = None) -> None:
        """Book [since, ts] to the current state's bucket (or `cause`), and move `since`."""
        span = max(0.0, ts - self.since)
        if self.state != _OUT:
            self.led.wall_s += span
            bucket = cause or {_LOAD: "load", _BACKOFF: "load", _NODE_WAIT: "node_wait",
                               _STOPPED: "stopped", _TRAIN: "stopped"}[self.state]
            self.led.lost_s[bucket] += span
        self.since = max(self.since, ts)

    def to(self, ts: float, state: str, cause: str | None = None) -> None:
        self.close(ts, cause)
        self.state = state

    def metrics(self, ts: float, next_token: int) -> None:
        if self.state == _LOAD:          # the run's first line: its load is over
            self.to(ts, _TRAIN)
        elif self.state == _TRAIN:
            self.train_span(ts, next_token)
        # Tokens count from where this run started (its first line's step included).
        new = max(0, next_token - max(self.token, self.high_water))
        again = max(0, min(next_token, self.high_water) - self.token)
        self.led.tokens_trained += new
        self.led.tokens_retrained += again
        self.token = next_token
        self.high_water = max(self.high_water, next_token)

    def train_span(self, ts: float, next_token: int) -> None:
        """A span between two metrics lines: new tokens are trained, old ones retrained
        (split by tokens when the span crosses the high-water mark); a save's stall out."""
        span = max(0.0, ts - self.since)
        stall = min(self.stall_s, span)
        self.stall_s -= stall
        work = span - stall
        done = max(1, next_token - self.token)
        again = max(0, min(next_token, self.high_water) - self.token)
        retrain = work * min(1.0, again / done)
        self.led.wall_s += span
        self.led.lost_s["checkpoint_stall"] += stall
        self.led.lost_s[self.retrain_cause] += retrain
        self.led.trained_s += work - retrain
        self.since = max(self.since, ts)


def compute_ledger(events: list[dict], metrics: dict[int, list[dict]],
                   now: float | None = None,
                   price_per_gpu_hour: float | None = None) -> Ledger:
    """The ledger of `events` (logs/events.jsonl records) and `metrics` (GPU -> its METRICS
    records). `now`: the time a still-running last session is counted up to (None: up to
    its last record, as for a launcher that died)."""
    marks = [(e.get("ts"), 0, e) for e in events]
    for gpu, records in metrics.items():
        marks += [(r.get("ts"), 1, {**r, "gpu": gpu}) for r in records]
    marks = [m for m in marks if isinstance(m[0], (int, float))]
    marks.sort(key=lambda m: (m[0], m[1]))
    sweeps: dict[int, _GpuSweep] = {}
    wall, sessions = 0.0, 0
    session_start: float | None = None
    canary_s, last_ts = 0.0, None
    in_session: set[int] = set()

    def end_session(ts: float) -> None:
        nonlocal wall, session_start
        for gpu in in_session:
            sweep = sweeps[gpu]
            sweep.to(ts, _OUT, cause="stopped" if sweep.state in (_BACKOFF, _TRAIN) else None)
        wall += max(0.0, ts - session_start)
        in_session.clear()
        session_start = None

    for ts, _, record in marks:
        name = record.get("event") if record.get("type") != "metrics" else "metrics"
        gpu = record.get("gpu")
        if name == "launch":
            if session_start is not None:        # the last launcher died unrecorded
                end_session(last_ts if last_ts is not None else ts)
            sessions += 1
            session_start = ts
            for g in record.get("gpus") or []:
                if not isinstance(g, int):
                    continue
                sweep = sweeps.setdefault(g, _GpuSweep(g))
                sweep.state, sweep.since = _LOAD, ts
                sweep.led.wall_s += canary_s
                sweep.led.lost_s["canary"] += canary_s
                in_session.add(g)
            wall += canary_s
            canary_s = 0.0
        elif name == "canary" and session_start is None:
            seconds = record.get("seconds")
            canary_s += float(seconds) if isinstance(seconds, (int, float)) and seconds > 0 else 0
        elif session_start is None:
            pass                                 # between sessions: nobody pays a GPU
        elif name in SESSION_ENDS:
            end_session(ts)
        elif isinstance(gpu, int) and gpu in in_session:
            _gpu_record(sweeps[gpu], ts, name, record)
        last_ts = ts if session_start is not None else last_ts
    if session_start is not None:
        end_session(max(now, last_ts) if now is not None else last_ts)
    return Ledger(wall_s=wall, gpus={g: s.led for g, s in sweeps.items()},
                  sessions=sessions, price_per_gpu_hour=price_per_gpu_hour)


def _gpu_record(sweep: _GpuSweep, ts: float, name: str, record: dict) -> None:
    """One record about `sweep`'s GPU inside a session: its state changes."""
    if name == "metrics":
        token = record.get("next_token")
        if isinstance(token, int):
            sweep.metrics(ts, token)
    elif name == "worker_start":
        sweep.to(ts, _LOAD)
        sweep.failing = False
        start = record.get("start_token")
        sweep.token = start if isinstance(start, int) else 0
    elif name == "checkpoint" and record.get("type") == "event":
        stall = record.get("stall_s")
        if isinstance(stall, (int, float)) and stall > 0:
            sweep.stall_s += float(stall)
    elif name == "hang":
        sweep.to(ts, _BACKOFF, cause="hang" if sweep.state == _TRAIN else None)
        sweep.retrain_cause = "retrain_crash"
    elif name == "check_failed":
        sweep.failing = True
    elif name == "worker_exit":
        crashed = record.get("code") not in (0, None)
        # A GPU killed for a rollback loses its work since the last line to the rollback.
        lost = "retrain_rollback" if sweep.failing else "crash" if crashed else "stopped"
        if sweep.state == _TRAIN:
            sweep.close(ts, cause=lost)
        sweep.to(ts, _BACKOFF if crashed else _STOPPED)
        if crashed and not sweep.failing:
            sweep.retrain_cause = "retrain_crash"
    elif name == "rollback":
        sweep.to(ts, _BACKOFF, cause="retrain_rollback" if sweep.state == _TRAIN else None)
        sweep.retrain_cause = "retrain_rollback"
    elif name in ("node_lost", "gpu_waiting"):
        sweep.to(ts, _NODE_WAIT)
        sweep.retrain_cause = "retrain_crash"


def pod_ledger(pod_dir: Path, now: float | None = None,
               price_per_gpu_hour: float | None = None) -> Ledger:
    """The ledger of the pod at `pod_dir`, from its files."""
    events = read_events(pod_dir)
    gpus = {g for e in events if e.get("event") == "launch" for g in (e.get("gpus") or [])
            if isinstance(g, int)}
    metrics = {}
    for gpu in sorted(gpus):
        path = pod_dir / metrics_path(gpu)
        metrics[gpu] = read_records(path) if path.is_file() else []
    return compute_ledger(events, metrics, now=now, price_per_gpu_hour=price_per_gpu_hour)
