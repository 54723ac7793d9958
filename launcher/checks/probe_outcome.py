"""One AR probe: request, outcome, what its verdict does to its GPU's checks; and
`stage_baseline`, the one baseline lookup the launcher's probes and `fractus-pod probe
--gpu` share, so both judge against the same number."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from launcher.checks.criteria import AT_ONCE
from launcher.checks.health import FAILED, SUCCESSFUL, CheckState, GpuHealth, Measurement
from launcher.checks.probe_check import Baseline
from launcher.files import read_json_state
from launcher.paths import BASELINES_FILE
from launcher.pod.events import read_events

BASELINE = "baseline"          # an outcome that set the baseline (no verdict)
CHECK_NAME = "probe"           # its name among the GPU's health checks


@dataclass(frozen=True)
class ProbeRequest:
    gpu: int
    checkpoint: str            # relative to the pod directory
    shard: str
    role: str                  # "baseline" (the resume checkpoint) or "check"
    sha256: str | None = None
    step: int | None = None
    head: int | None = None    # where its windows start (None: the head the file records)


@dataclass
class ProbeOutcome:
    request: ProbeRequest
    status: str                # SUCCESSFUL / FAILED / INCONCLUSIVE, or BASELINE
    reason: str
    result: dict | None = None
    seconds: float = 0.0
    baseline: Baseline | None = None

    @property
    def baseline_ar(self) -> float | None:
        return self.baseline.ar if self.baseline else None

    def event_fields(self) -> dict:
        r = self.request
        numbers = {k: self.result.get(k) for k in ("ar", "ar_acc", "cold_tf", "ar_rows",
                                                   "vocab_size")} if self.result else {}
        where = {"node": self.result["node"]} if self.result and "node" in self.result else {}
        return {"gpu": r.gpu, **where, "role": r.role, "status": self.status,
                "reason": self.reason, "shard": r.shard,
                "checkpoint": r.checkpoint, "sha256": r.sha256, "step": r.step,
                "baseline_ar": self.baseline_ar,
                "baseline_spread": self.baseline.spread() if self.baseline else None,
                "seconds": round(self.seconds, 2), **numbers}


def apply_outcome(outcome: ProbeOutcome, health: GpuHealth) -> str | None:
    """Failed: fails the GPU's stage, returns why (that checkpoint and newer ones are to fail).
    Otherwise a `probe` measurement (no probe ever run keeps it Inconclusive); None."""
    if outcome.status == BASELINE:
        return None
    reason = f"{outcome.reason} ({outcome.request.checkpoint})"
    if outcome.status == FAILED:
        health.fail(CHECK_NAME, reason)
        return reason
    check = health.checks.setdefault(CHECK_NAME, CheckState(CHECK_NAME, AT_ONCE))
    check.record(Measurement(True if outcome.status == SUCCESSFUL else None, reason))
    return None


def recorded_baseline(pod_dir: Path, stage: int, gpu: int) -> Baseline | None:
    """The baseline recorded for `gpu` at `stage` (`fractus-pod probe --record-baseline`)."""
    return Baseline.of(read_json_state(pod_dir / BASELINES_FILE).get(str(stage), {})
                       .get(str(gpu)))


def stage_baseline(pod_dir: Path, stage: int, gpu: int, shard: str | Path
                   ) -> tuple[Baseline, str] | None:
    """(baseline, source) for `gpu` at `stage` on `shard`: the recorded one, else the newest
    `probe` event with status baseline for that stage, GPU and shard; or None."""
    recorded = recorded_baseline(pod_dir, stage, gpu)
    if recorded is not None:
        return recorded, f"recorded for stage {stage}"
    where = (pod_dir / shard).resolve()
    for event in reversed(read_events(pod_dir)):
        if event.get("event") != CHECK_NAME or event.get("status") != BASELINE or \
                event.get("stage") != stage or event.get("gpu") != gpu or \
                not isinstance(event.get("shard"), str) or \
                (pod_dir / event["shard"]).resolve() != where:
            continue
        baseline = Baseline.of(event)
        if baseline is not None and math.isfinite(baseline.ar):
            return baseline, f"set by the launcher's probes at stage {stage}"
    return None
