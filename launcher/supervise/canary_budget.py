"""How `launch --max-time T` (counted from the start of `launch`) splits between the stage
canary and training: said before anything starts; a budget the canary alone would use up is
refused (exit 2). The estimate is what this pod measured, never a guess (docs/CANARY.md
"Budget"): the last canary, else the GPU's last worker run, else only the canary's bound."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from launcher.errors import UserError
from launcher.pod.events import read_events
from launcher.worker.process import read_records
from launcher.paths import metrics_path

CANARY_RUNS = 2      # the reference stage's run, then the new stage's (launcher/checks/canary.py)


@dataclass(frozen=True)
class CanaryEstimate:
    seconds: float
    basis: str       # what it was measured from, said to the person


def estimate_canary(pod_dir: Path, gpu: int, steps: int) -> CanaryEstimate | None:
    """The canary's expected duration on GPU `gpu` (None: nothing measured on this pod)."""
    for record in reversed(read_events(pod_dir)):
        if record.get("event") != "canary" or record.get("interrupted"):
            continue
        seconds = record.get("seconds")
        if not isinstance(seconds, (int, float)) or not seconds > 0:
            continue
        ran = len(record.get("per_step") or []) or steps
        scale = max(1.0, steps / ran)
        return CanaryEstimate(seconds * scale, "the last canary on this pod")
    return _from_worker_run(pod_dir, gpu, steps)


def _from_worker_run(pod_dir: Path, gpu: int, steps: int) -> CanaryEstimate | None:
    records = read_records(pod_dir / metrics_path(gpu))
    starts = [r for r in records if r.get("event") == "start" and isinstance(r.get("ts"), float)]
    if not starts:
        return None
    start = starts[-1]
    launched = [e for e in read_events(pod_dir) if e.get("event") == "worker_start"
                and e.get("gpu") == gpu and e.get("pid") == start.get("pid")]
    lines = [r for r in records if r.get("type") == "metrics" and r.get("ts", 0) >= start["ts"]
             and isinstance(r.get("step"), int)]
    if not launched or len(lines) < 2 or lines[-1]["step"] <= lines[0]["step"]:
        return None
    startup = max(0.0, start["ts"] - launched[-1]["ts"])
    per_step = (lines[-1]["ts"] - lines[0]["ts"]) / (lines[-1]["step"] - lines[0]["step"])
    return CanaryEstimate(CANARY_RUNS * (startup + steps * per_step),
                          f"GPU {gpu}'s last worker run ({startup:.0f}s to start, "
                          f"{per_step:.2f}s a step)")


def split_budget(plan, canary_runs: bool) -> str | None:
    """The line saying how --max-time splits, or None; UserError: the canary uses it up."""
    if plan.max_time is None or not canary_runs:
        return None
    settings = plan.trusted.canary
    slot = plan.slots[0]
    estimate = estimate_canary(plan.pod_dir, slot.gpu, settings.steps)
    runs = f"{CANARY_RUNS} runs of {settings.steps} steps on GPU {slot.gpu}"
    if estimate is None:
        return (f"--max-time {plan.max_time:g}s: the canary ({runs}, at most "
                f"{settings.timeout_s:g}s by canary.timeout_s) runs first and spends this "
                f"budget; the workers train in what is left")
    if estimate.seconds >= plan.max_time:
        raise UserError(f"--max-time {plan.max_time:g}s would be spent by the canary alone "
                        f"(about {estimate.seconds:.0f}s for {runs}, from {estimate.basis}), "
                        f"leaving no time to train; give --max-time above "
                        f"{estimate.seconds:.0f}, or switch stage first without --max-time")
    return (f"--max-time {plan.max_time:g}s: about {estimate.seconds:.0f}s for the canary "
            f"({runs}, from {estimate.basis}), about "
            f"{plan.max_time - estimate.seconds:.0f}s left to train")
