"""The `canary:` section of manifests/trusted_loss.yaml, typed; no default here (the
shipped file's section holds every key, shipped_defaults.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from launcher.checks.canary_compare import Tolerance
from launcher.checks.criteria import typed_section
from launcher.errors import UserError, refuse_unknown_keys


@dataclass(frozen=True)
class CanarySettings:
    steps: int
    timeout_s: float
    # float32 CPU runs agree to float rounding; bf16 CUDA is twice bf16's measured band
    # against float32 (see docs/CANARY.md).
    exact: dict                 # device ("cpu", "cuda") -> Tolerance
    max_ema_tf_rise: float      # approximate stages: last ema_tf vs stage M's


def parse_canary(section, path: Path) -> CanarySettings:
    where = f"{path}: canary"
    if not isinstance(section, dict):
        raise UserError(f"{where}: expected a mapping")
    refuse_unknown_keys(section, {"steps", "timeout_s", "exact", "approximate"}, where)
    exact = section.get("exact") or {}
    if not isinstance(exact, dict) or not set(exact) <= {"cpu", "cuda"}:
        raise UserError(f"{where}.exact: expected cpu/cuda: {{rtol, atol}}, got {exact!r}")
    approx = typed_section(_Approximate, f"{where}.approximate", section.get("approximate"))
    times = typed_section(_Times, where, {k: section.get(k) for k in ("steps", "timeout_s")},
                          least={"steps": 2})
    return CanarySettings(
        times.steps, times.timeout_s, max_ema_tf_rise=approx.maxEmaTfRise,
        exact={device: typed_section(Tolerance, f"{where}.exact.{device}", tol)
               for device, tol in exact.items()})


@dataclass(frozen=True)
class _Times:
    steps: int
    timeout_s: float


@dataclass(frozen=True)
class _Approximate:
    maxEmaTfRise: float
