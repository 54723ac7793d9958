"""Trusted-loss health checks over one GPU's metrics records (no I/O, no clocks): the clock
is the worker's `step`, relative to the first seen at this stage. Each check measures every
`interval` steps after `initialDelay`, counts failures against `failureLimit` and ends
Successful, Failed or Inconclusive once the stage window is covered (Argo Rollouts analysis
semantics).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from fractus.train.exit_codes import WorkerExitCode
from launcher.checks.criteria import AT_ONCE, CHECKS, CheckSpec, Criteria

PENDING, RUNNING, SUCCESSFUL, FAILED, INCONCLUSIVE = (
    "Pending", "Running", "Successful", "Failed", "Inconclusive")

FINITE_FIELDS = ("tf", "ema_tf", "ss", "ema_ss", "lb", "grad_norm")
# The worker writes non-finite floats as null (strict JSON). These are always measured, so
# a null there means NaN/Inf; ss/ema_ss are null when no scheduled-sampling pass ran yet.
ALWAYS_PRESENT = ("tf", "ema_tf", "lb", "grad_norm")
# Their baseline is the curve so far, which changes with the data: they start over at a
# data phase switch (new_phase).
CURVE_CHECKS = ("trend", "lb_band", "loss_spike")


@dataclass
class Measurement:
    ok: bool | None          # None: the check could not measure (missing data)
    reason: str = ""


@dataclass
class CheckState:
    name: str
    spec: CheckSpec
    next_tick: int = 0
    successes: int = 0
    failures: int = 0
    inconclusive: int = 0
    reason: str = ""
    forced_failure: bool = False
    starts_at: int = 0       # the step (relative to the stage's first) its clock starts at

    def __post_init__(self):
        self.next_tick = self.starts_at + self.spec.initialDelay

    def record(self, m: Measurement) -> None:
        if m.ok is None:
            self.inconclusive += 1
        elif m.ok:
            self.successes += 1
        else:
            self.failures += 1
        if m.reason and (m.ok is not True or self.failures == 0):
            self.reason = m.reason

    def phase(self, rel_step: int | None, window: int) -> str:
        if self.forced_failure or self.failures > self.spec.failureLimit:
            return FAILED
        if rel_step is not None and rel_step >= window:
            if self.successes > 0:
                return SUCCESSFUL
            if self.inconclusive > 0:
                return INCONCLUSIVE
        if self.successes + self.failures + self.inconclusive == 0:
            return PENDING
        return RUNNING


@dataclass
class Verdict:
    phase: str
    reason: str
    checks: dict = field(default_factory=dict)   # name -> {"phase","failures","reason"}

    def to_dict(self) -> dict:
        return {"phase": self.phase, "reason": self.reason, "checks": self.checks}


def _finite(record: dict) -> Measurement:
    for name in FINITE_FIELDS:
        value = record.get(name)
        if value is None:
            if name in ALWAYS_PRESENT and name in record:
                return Measurement(False, f"{name}=null (NaN/Inf) at step {record.get('step')}")
            continue
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            return Measurement(False, f"{name}={value} at step {record.get('step')}")
    return Measurement(True)


class GpuHealth:
    """Incremental health analysis of one GPU at one stage."""

    def __init__(self, criteria: Criteria, window: int, lb_baseline: float | None = None,
                 resume_ema_tf: float | None = None):
        self.criteria = criteria
        self.window = window
        self.lb_baseline = lb_baseline
        self.lb_baseline_source = "previous stage" if lb_baseline is not None else None
        self.checks = {name: CheckState(name, getattr(criteria, name)) for name in CHECKS}
        self.base_step: int | None = None
        self.rel_step: int | None = None
        self.verified_step: int | None = None   # newest step every check vouched for
        self._ema_history: deque = deque()       # (rel_step, ema_tf) within trend lookback
        self._tf_window: deque = deque(maxlen=max(1, criteria.loss_spike.windowLogs))
        self._spike_run = 0
        self._latest: dict = {}
        self._await_continuity = False
        self._phase_note = "first log of this stage"    # where lb_band's own baseline comes from
        # Without any periodic check, every clean line vouches for the steps before it.
        self._has_periodic = any(c.spec.interval > 0 for n, c in self.checks.items()
                                 if n != "continuity")
        self.start(resume_ema_tf)

    def start(self, resume_ema_tf: float | None) -> None:
        """A worker (re)started from a checkpoint whose ema_tf was `resume_ema_tf`."""
        self._resume_ema_tf = resume_ema_tf
        self._await_continuity = True
        self._spike_run = 0

    def new_phase(self, phase: int) -> None:
        """Data phase `phase` began: the loss may jump on new data, no regression. The
        CURVE_CHECKS start over as at a new stage; the other checks and the stage window go
        on. The caller restarts the worker with no curve to continue."""
        first = self.rel_step + 1 if self.rel_step is not None else 0
        for name in CURVE_CHECKS:
            self.checks[name] = CheckState(name, self.checks[name].spec, starts_at=first)
        self._ema_history.clear()
        self._tf_window.clear()
        self._spike_run = 0
        self.lb_baseline, self.lb_baseline_source = None, None
        self._phase_note = f"first log of phase {phase}"

    def fail(self, name: str, reason: str) -> None:
        """A failure observed outside the metrics (exit code, crash loop, hang)."""
        check = self.checks.setdefault(name, CheckState(name, AT_ONCE))
        check.forced_failure = True
        check.reason = reason

    def exit_code(self, code: int) -> None:
        if code == WorkerExitCode.NAN:
            self.fail("finite", f"worker exited {code:d} (NaN/Inf loss)")
        elif code == WorkerExitCode.OOM:
            self.fail("oom", f"worker exited {code:d} (out of memory)")

    def event(self, record: dict) -> None:
        kind = record.get("event")
        if kind == "nan":
            self.fail("finite", f"nan event at step {record.get('step')}")
        elif kind == "oom":
            self.fail("oom", f"oom event at step {record.get('step')}")

    def feed(self, record: dict) -> None:
        step = int(record.get("step", 0))
        if self.base_step is None:
            self.base_step = step
        rel = step - self.base_step
        self.rel_step = rel if self.rel_step is None else max(self.rel_step, rel)
        self._latest = record
        finite = _finite(record)
        measured_periodic, all_ok = False, True

        for name, check in self.checks.items():
            m = self._measure(name, check, record, rel, finite)
            if m is None:
                continue
            check.record(m)
            if m.ok is False:
                all_ok = False
            if check.spec.interval > 0 and name not in ("continuity",):
                measured_periodic = True

        if finite.ok:
            self._remember(record, rel)
        if all_ok and not self.failed() and (measured_periodic or not self._has_periodic):
            self.verified_step = step

    def close_out(self) -> None:
        """Clean end: each due periodic check measures the newest line, so no step is unjudged."""
        record, rel = self._latest, self.rel_step
        if not record or rel is None or self.failed() or not _finite(record).ok:
            return
        step = int(record.get("step", 0))
        if self.verified_step is not None and self.verified_step >= step:
            return
        periodic = {"trend": self._trend, "lb_band": self._lb_band, "ss_ratio": self._ss_ratio}
        measured, all_ok = False, True
        for name, measure in periodic.items():
            check = self.checks[name]
            if check.spec.interval <= 0 or rel < check.starts_at + check.spec.initialDelay:
                continue
            m = measure(record, rel)
            check.record(m)
            measured, all_ok = True, all_ok and m.ok is not False
        if all_ok and not self.failed() and (measured or not self._has_periodic):
            self.verified_step = step

    def _measure(self, name, check, record, rel, finite) -> Measurement | None:
        if name == "finite":
            return finite
        if not finite.ok:
            return None      # the other checks only look at finite numbers
        if name == "continuity":
            if not self._await_continuity:
                return None
            self._await_continuity = False
            return self._continuity(record)
        if name == "loss_spike":
            return self._loss_spike(record)
        if check.spec.interval == 0 or rel < check.next_tick:
            return None
        while check.next_tick <= rel:
            check.next_tick += check.spec.interval
        return {"trend": self._trend, "lb_band": self._lb_band,
                "ss_ratio": self._ss_ratio}[name](record, rel)

    def _continuity(self, record: dict) -> Measurement:
        if self._resume_ema_tf is None:
            return Measurement(True, "fresh start: no curve to continue")
        first = record.get("ema_tf")
        if first is None:
            return Measurement(None, "no ema_tf in the first metrics line")
        delta = abs(first - self._resume_ema_tf)
        limit = self.criteria.continuity.maxAbsDelta
        ok = delta <= limit
        return Measurement(ok, f"first ema_tf {first:.4f} vs checkpoint {self._resume_ema_tf:.4f} "
                               f"(|delta| {delta:.4f} {'<=' if ok else '>'} {limit})")

    def _trend(self, record: dict, rel: int) -> Measurement:
        spec = self.criteria.trend
        latest = record.get("ema_tf")
        window = [v for s, v in self._ema_history if s >= rel - spec.lookback]
        if latest is None or len(window) < 2:
            return Measurement(None, "not enough ema_tf values in the lookback window")
        lowest = min(window + [latest])
        ok = latest <= lowest + spec.tolerance
        return Measurement(ok, f"ema_tf {latest:.4f} vs window min {lowest:.4f} "
                               f"(+{latest - lowest:.4f}, tolerance {spec.tolerance})")

    def _lb_band(self, record: dict, rel: int) -> Measurement:
        spec = self.criteria.lb_band
        lb = record.get("lb")
        if lb is None:
            return Measurement(None, "no lb in metrics")
        if self.lb_baseline is None:
            self.lb_baseline, self.lb_baseline_source = lb, self._phase_note
        band = (spec.relativeBand * abs(self.lb_baseline) if spec.relativeBand is not None
                else spec.band)
        ok = abs(lb - self.lb_baseline) <= band
        return Measurement(ok, f"lb {lb:.3f} vs baseline {self.lb_baseline:.3f} "
                               f"({self.lb_baseline_source}), band {band:.3f}")

    def _ss_ratio(self, record: dict, rel: int) -> Measurement:
        ema_ss, ema_tf = record.get("ema_ss"), record.get("ema_tf")
        if ema_ss is None or not ema_tf:
            return Measurement(None, "no ema_ss yet (scheduled sampling has not run)")
        ratio = ema_ss / ema_tf
        limit = self.criteria.ss_ratio.maxRatio
        return Measurement(ratio <= limit, f"ema_ss/ema_tf {ratio:.3f} (max {limit})")

    def _loss_spike(self, record: dict) -> Measurement | None:
        spec = self.criteria.loss_spike
        tf = record.get("tf")
        if tf is None:
            return None
        full = len(self._tf_window) == self._tf_window.maxlen
        mean = sum(self._tf_window) / len(self._tf_window) if self._tf_window else None
        if not full or mean is None or mean <= 0:
            return None      # CE is >= 0: a non-positive mean makes the ratio meaningless
        if tf > spec.factor * mean:
            self._spike_run += 1
        else:
            self._spike_run = 0
        ok = self._spike_run < spec.patience
        return Measurement(ok, f"tf {tf:.4f} vs {spec.factor} x rolling mean {mean:.4f}, "
                               f"{self._spike_run} consecutive spike(s) (patience {spec.patience})")

    def _remember(self, record: dict, rel: int) -> None:
        if record.get("ema_tf") is not None:
            self._ema_history.append((rel, record["ema_tf"]))
            lookback = self.criteria.trend.lookback
            while self._ema_history and self._ema_history[0][0] < rel - lookback:
                self._ema_history.popleft()
        if record.get("tf") is not None:
            # A spike is judged against the window before it, so append after measuring.
            self._tf_window.append(record["tf"])

    def failed(self) -> bool:
        """Cheap, for every line (verdict() builds the full report)."""
        return any(c.forced_failure or c.failures > c.spec.failureLimit
                   for c in self.checks.values())

    def phase(self) -> str:
        return FAILED if self.failed() else self.verdict().phase

    def verdict(self) -> Verdict:
        phases = {name: c.phase(self.rel_step, self.window) for name, c in self.checks.items()}
        details = {name: {"phase": phases[name], "failures": c.failures, "reason": c.reason}
                   for name, c in self.checks.items()}
        for wanted in (FAILED, INCONCLUSIVE):
            bad = [n for n, p in phases.items() if p == wanted]
            if bad and (wanted == FAILED or all(p in (SUCCESSFUL, INCONCLUSIVE)
                                               for p in phases.values())):
                name = bad[0]
                return Verdict(wanted, f"{name}: {self.checks[name].reason}", details)
        if all(p == SUCCESSFUL for p in phases.values()):
            return Verdict(SUCCESSFUL, f"all checks passed over {self.window} steps", details)
        done = self.rel_step if self.rel_step is not None else 0
        phase = PENDING if self.rel_step is None else RUNNING
        return Verdict(phase, f"{done}/{self.window} steps of the stage window", details)


def analyze(criteria: Criteria, window: int, records: list[dict],
            lb_baseline: float | None = None, resume_ema_tf: float | None = None,
            exit_code: int | None = None) -> Verdict:
    """Pure fold: the verdict for one GPU's records (metrics and events) at one stage."""
    health = GpuHealth(criteria, window, lb_baseline, resume_ema_tf)
    for record in records:
        if record.get("type") == "event":
            health.event(record)
        else:
            health.feed(record)
    if exit_code is not None:
        health.exit_code(exit_code)
    return health.verdict()
