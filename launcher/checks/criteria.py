"""The trusted-loss criteria file (manifests/trusted_loss.yaml) as typed config objects.

Every threshold the health checks use comes from here; the check logic lives in
launcher/checks/health.py. Unknown keys are refused so a typo never silently disables a check.
The `canary:` and `probe:` sections belong to the stage canary and the AR probe verdict:
they are parsed (and their keys checked) by launcher/checks/canary.py and launcher/checks/probe_check.py.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

from launcher.errors import UserError, refuse_unknown_keys
from launcher.config.yamlfile import read_yaml


@dataclass(frozen=True)
class CheckSpec:
    """Scheduling shared by every check (Argo Rollouts analysis vocabulary)."""
    interval: int = 0          # steps between measurements; 0 = every metrics line
    initialDelay: int = 0      # steps after the stage began before the first measurement
    failureLimit: int = 0      # Failed once failed measurements exceed this


@dataclass(frozen=True)
class FiniteSpec(CheckSpec):
    pass


@dataclass(frozen=True)
class ContinuitySpec(CheckSpec):
    maxAbsDelta: float = 0.5


@dataclass(frozen=True)
class TrendSpec(CheckSpec):
    lookback: int = 400
    tolerance: float = 0.15


@dataclass(frozen=True)
class LbBandSpec(CheckSpec):
    band: float | None = 3.0
    relativeBand: float | None = None


@dataclass(frozen=True)
class SsRatioSpec(CheckSpec):
    maxRatio: float = 1.6


@dataclass(frozen=True)
class LossSpikeSpec(CheckSpec):
    windowLogs: int = 50
    factor: float = 2.0
    patience: int = 4


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 3
    window_s: float = 900.0
    backoff_s: float = 2.0
    backoff_max_s: float = 60.0

    def backoff(self, attempt: int) -> float:
        """Delay before restart number `attempt` (1-based): doubles, capped."""
        return min(self.backoff_max_s, self.backoff_s * (2 ** max(0, attempt - 1)))


@dataclass(frozen=True)
class HangPolicy:
    timeout_s: float = 600.0
    startup_timeout_s: float = 1200.0


@dataclass(frozen=True)
class Criteria:
    finite: FiniteSpec = field(default_factory=FiniteSpec)
    continuity: ContinuitySpec = field(default_factory=ContinuitySpec)
    trend: TrendSpec = field(default_factory=TrendSpec)
    lb_band: LbBandSpec = field(default_factory=LbBandSpec)
    ss_ratio: SsRatioSpec = field(default_factory=SsRatioSpec)
    loss_spike: LossSpikeSpec = field(default_factory=LossSpikeSpec)
    restarts: RestartPolicy = field(default_factory=RestartPolicy)
    hang: HangPolicy = field(default_factory=HangPolicy)


# The one registry of checks: name -> its spec; health.py measures each of them, in order.
CHECKS = {"finite": FiniteSpec, "continuity": ContinuitySpec, "trend": TrendSpec,
          "lb_band": LbBandSpec, "ss_ratio": SsRatioSpec, "loss_spike": LossSpikeSpec}
_SUPERVISION_CLASSES = {"restarts": RestartPolicy, "hang": HangPolicy}
# Top-level sections owned by other modules (see the module docstring).
OTHER_SECTIONS = ("canary", "probe")


def _build(cls, where: str, data) -> object:
    if data is None:
        return cls()
    if not isinstance(data, dict):
        raise UserError(f"{where}: expected a mapping, got {type(data).__name__}")
    names = {f.name: f for f in dataclasses.fields(cls)}
    refuse_unknown_keys(data, names, where)
    values = {}
    for key, value in data.items():
        default = getattr(cls(), key)
        if value is None and default is None:
            values[key] = None
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UserError(f"{where}.{key}: expected a number, got {value!r}; the default "
                            f"is {default!r}")
        # Finite: a NaN tolerance or an infinite band is a check that can never fail.
        if not 0 <= value < math.inf:
            raise UserError(f"{where}.{key}: must be a finite number >= 0, got {value}; the "
                            f"default is {default!r}")
        is_int_field = isinstance(default, int) and not isinstance(default, bool)
        if is_int_field and value != int(value):
            raise UserError(f"{where}.{key}: expected an integer, got {value!r}")
        values[key] = int(value) if is_int_field else float(value)
    return cls(**values)


def parse_criteria(data: dict, source: str = "criteria") -> Criteria:
    if not isinstance(data, dict):
        raise UserError(f"{source}: expected a mapping with 'checks' and 'supervision'")
    unknown = sorted(set(data) - {"checks", "supervision", *OTHER_SECTIONS})
    if unknown:
        raise UserError(f"{source}: unknown top-level key(s) {unknown}; known: "
                        f"{['checks', 'supervision', *OTHER_SECTIONS]}")
    checks = data.get("checks") or {}
    supervision = data.get("supervision") or {}
    for section, known in (("checks", CHECKS), ("supervision", _SUPERVISION_CLASSES)):
        given = data.get(section) or {}
        if not isinstance(given, dict):
            raise UserError(f"{source}: '{section}' must be a mapping")
        bad = sorted(set(given) - set(known))
        if bad:
            raise UserError(f"{source}: unknown {section} {bad}; known: {sorted(known)}")
    parts = {name: _build(cls, f"{source}: checks.{name}", checks.get(name))
             for name, cls in CHECKS.items()}
    parts.update({name: _build(cls, f"{source}: supervision.{name}", supervision.get(name))
                  for name, cls in _SUPERVISION_CLASSES.items()})
    return Criteria(**parts)


def load_criteria(path: str | Path) -> Criteria:
    return parse_criteria(read_yaml(path, "criteria file"), str(path))
