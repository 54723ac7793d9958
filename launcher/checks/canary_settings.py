"""The `canary:` section of the criteria file (manifests/trusted_loss.yaml), typed.

Parsed once with the rest of the file (launcher/checks/trusted_loss.py) over the shipped
file's section (launcher/checks/shipped_defaults.py: every key is there, no default here);
the canary (launcher/checks/canary.py) reads it from the launch plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from launcher.checks.canary_compare import Tolerance
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
    """The `canary:` section of the criteria file, over the shipped file's section
    (launcher/checks/shipped_defaults.py): every key is there."""
    where = f"{path}: canary"
    if not isinstance(section, dict):
        raise UserError(f"{where}: expected a mapping")
    refuse_unknown_keys(section, {"steps", "timeout_s", "exact", "approximate"}, where)
    exact = {}
    for device, tol in (section.get("exact") or {}).items():
        if device not in ("cpu", "cuda") or not isinstance(tol, dict) \
                or set(tol) != {"rtol", "atol"}:
            raise UserError(f"{where}.exact: expected cpu/cuda: {{rtol, atol}}, "
                            f"got {device}: {tol!r}")
        at = f"{where}.exact.{device}"
        exact[device] = Tolerance(_number(f"{at}.rtol", tol["rtol"]),
                                  _number(f"{at}.atol", tol["atol"]))
    approx = section.get("approximate")
    if not isinstance(approx, dict) or set(approx) != {"maxEmaTfRise"}:
        raise UserError(f"{where}.approximate: expected {{maxEmaTfRise}}, got {approx!r}")
    steps = section.get("steps")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2:
        raise UserError(f"{where}.steps: expected an integer >= 2, got {steps!r}")
    return CanarySettings(
        steps=steps, timeout_s=_number(f"{where}.timeout_s", section.get("timeout_s")),
        exact=exact, max_ema_tf_rise=_number(f"{where}.approximate.maxEmaTfRise",
                                             approx["maxEmaTfRise"]))


def _number(where: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not 0 <= value < math.inf:
        raise UserError(f"{where}: expected a finite number >= 0, got {value!r}")
    return float(value)
