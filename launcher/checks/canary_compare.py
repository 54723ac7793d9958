"""The canary's verdicts, pure: two runs' metrics records in, a verdict out (protocol:
canary.py)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from launcher.checks.criteria import Criteria
from launcher.checks.health import FAILED, analyze


@dataclass(frozen=True)
class Tolerance:
    """|new - ref| <= atol + rtol * |ref|, per step, for each of EXACT_KEYS."""
    rtol: float
    atol: float = 0.0

    def allows(self, ref: float, new: float) -> bool:
        return abs(new - ref) <= self.atol + self.rtol * abs(ref)


@dataclass(frozen=True)
class StepComparison:
    step: int
    next_token: int | None
    tf_from: float | None
    tf_to: float | None
    lb_from: float | None
    lb_to: float | None
    ok: bool
    grad_norm_from: float | None = None
    grad_norm_to: float | None = None


def metrics_lines(records: list[dict]) -> list[dict]:
    return [r for r in records if r.get("type") == "metrics"]


def _finite(*values) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)


# grad_norm (before clipping) checks the gradients directly: under a wrong attention
# normalisation it moves ~10x more than tf on the tiny model, at the same rounding noise.
EXACT_KEYS = ("tf", "lb", "grad_norm")


def _row(step: int, ref: dict, new: dict, ok: bool) -> StepComparison:
    return StepComparison(step, new.get("next_token"), ref.get("tf"), new.get("tf"),
                          ref.get("lb"), new.get("lb"), ok,
                          ref.get("grad_norm"), new.get("grad_norm"))


def compare_exact(ref: list[dict], new: list[dict], tol: Tolerance, steps: int,
                  names: tuple[str, str] = ("stage M", "stage N")) -> tuple[bool, str, list]:
    a, b = names
    ref, by_step = metrics_lines(ref), {r["step"]: r for r in metrics_lines(new)}
    if len(ref) < steps:
        return False, f"{a} logged {len(ref)} of {steps} steps", []
    rows, worst = [], dict.fromkeys(EXACT_KEYS, 0.0)
    for r in ref[:steps]:
        n = by_step.get(r["step"])
        if n is None:
            return False, f"step {r['step']}: {b} logged no metrics", rows
        row = _row(r["step"], r, n, ok=False)
        if n.get("next_token") != r.get("next_token"):
            rows.append(row)
            return False, (f"step {r['step']}: the runs read different tokens (next_token "
                           f"{r.get('next_token')} vs {n.get('next_token')}): not comparable "
                           f"step for step"), rows
        for key in EXACT_KEYS:
            x, y = r.get(key), n.get(key)
            if not _finite(x, y) or not tol.allows(x, y):
                rows.append(row)
                diff = abs(y - x) if _finite(x, y) else float("nan")
                return False, (f"step {r['step']}: {key} {x!r} ({a}) vs {y!r} ({b}), "
                               f"|diff| {diff:.3g} > {tol.atol:g} + {tol.rtol:g}*|{key}|"), rows
            worst[key] = max(worst[key], abs(y - x) / max(abs(x), 1e-30))
        rows.append(dataclasses.replace(row, ok=True))
    diffs = ", ".join(f"{k} {v:.2g}" for k, v in worst.items())
    return True, (f"{b} matches {a} on {steps} steps (max relative diff {diffs}; "
                  f"rtol {tol.rtol:g}, atol {tol.atol:g})"), rows


def compare_approximate(ref: list[dict], new: list[dict], criteria: Criteria, steps: int,
                        max_ema_tf_rise: float, resume_ema_tf: float | None = None,
                        names: tuple[str, str] = ("stage M", "stage N")) -> tuple[bool, str, list]:
    """The trusted-loss checks on `new` over K steps, then its last ema_tf against `ref`'s."""
    a, b = names
    ref_m, new_m = metrics_lines(ref), metrics_lines(new)
    rows = [_row(r["step"], r, n, ok=_finite(n.get("tf"), n.get("lb")))
            for r, n in zip(ref_m, new_m)]
    if len(new_m) < steps or len(ref_m) < steps:
        return False, f"{a} logged {len(ref_m)}, {b} {len(new_m)} of {steps} steps", rows
    lb_baseline = ref_m[0].get("lb") if _finite(ref_m[0].get("lb")) else None
    verdict = analyze(criteria, steps, new, lb_baseline=lb_baseline, resume_ema_tf=resume_ema_tf)
    if verdict.phase == FAILED:
        return False, f"{b} fails the trusted-loss checks: {verdict.reason}", rows
    last_ref, last_new = ref_m[steps - 1].get("ema_tf"), new_m[steps - 1].get("ema_tf")
    if not _finite(last_ref, last_new):
        return False, f"ema_tf not finite after {steps} steps: {last_ref!r} vs {last_new!r}", rows
    if last_new > last_ref + max_ema_tf_rise:
        return False, (f"step {new_m[steps - 1]['step']}: ema_tf {last_new:.4f} ({b}) above "
                       f"{last_ref:.4f} ({a}) by {last_new - last_ref:.4f} > "
                       f"maxEmaTfRise {max_ema_tf_rise:g}"), rows
    return True, (f"{b} passes the trusted-loss checks over {steps} steps; ema_tf {last_new:.4f} "
                  f"vs {last_ref:.4f} ({a}), within +{max_ema_tf_rise:g}"), rows
