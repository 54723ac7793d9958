"""`checks:`, `supervision:` and `peers:` of manifests/trusted_loss.yaml typed, and
`typed_section`, the builder of every section of that file. No field has a default in code
(a missing key takes the shipped file's value, shipped_defaults.py) and unknown keys are
refused, so a typo never disables a check.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass

from launcher.errors import UserError, refuse_unknown_keys
from launcher.checks.shipped_defaults import with_shipped_defaults


@dataclass(frozen=True)
class CheckSpec:
    """Scheduling shared by every check (Argo Rollouts analysis vocabulary)."""
    interval: int              # steps between measurements; 0 = every metrics line
    initialDelay: int          # steps after the stage began before the first measurement
    failureLimit: int          # Failed once failed measurements exceed this


# A check judged outside the metrics lines (a forced failure, the probe): first failure fails.
AT_ONCE = CheckSpec(interval=0, initialDelay=0, failureLimit=0)


@dataclass(frozen=True)
class FiniteSpec(CheckSpec):
    pass


@dataclass(frozen=True)
class ContinuitySpec(CheckSpec):
    maxAbsDelta: float


@dataclass(frozen=True)
class TrendSpec(CheckSpec):
    lookback: int
    tolerance: float


@dataclass(frozen=True)
class LbBandSpec(CheckSpec):
    band: float | None
    relativeBand: float | None


@dataclass(frozen=True)
class SsRatioSpec(CheckSpec):
    maxRatio: float


@dataclass(frozen=True)
class LossSpikeSpec(CheckSpec):
    windowLogs: int
    factor: float
    patience: int


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int
    window_s: float
    backoff_s: float
    backoff_max_s: float

    def backoff(self, attempt: int) -> float:
        """Delay before restart number `attempt` (1-based): doubles, capped."""
        return min(self.backoff_max_s, self.backoff_s * (2 ** max(0, attempt - 1)))


@dataclass(frozen=True)
class HangPolicy:
    timeout_s: float
    startup_timeout_s: float


@dataclass(frozen=True)
class PeersThresholds:
    """Each GPU judged against the others of the pod (launcher/checks/peers.py)."""
    fraction: float              # straggler: median tok_s below fraction x its peers' median
    windowLines: int             # the last metrics lines of each GPU the medians are over
    k: float                     # loss outlier: ema_tf more than k robust deviations off
    minDeviation: float          # floor of the peers' robust deviation (nats)
    minGpus: int                 # fewer GPUs with a full window: no verdict


PEER_ACTIONS = ("alert", "rollback")


@dataclass(frozen=True)
class PeersSpec(PeersThresholds):
    action: str                  # alert (event + status mark) or rollback (fails the GPU)


@dataclass(frozen=True)
class Criteria:
    finite: FiniteSpec
    continuity: ContinuitySpec
    trend: TrendSpec
    lb_band: LbBandSpec
    ss_ratio: SsRatioSpec
    loss_spike: LossSpikeSpec
    restarts: RestartPolicy
    hang: HangPolicy
    peers: PeersSpec


# The one registry of checks: name -> its spec; health.py measures each of them, in order.
CHECKS = {"finite": FiniteSpec, "continuity": ContinuitySpec, "trend": TrendSpec,
          "lb_band": LbBandSpec, "ss_ratio": SsRatioSpec, "loss_spike": LossSpikeSpec}
_SUPERVISION_CLASSES = {"restarts": RestartPolicy, "hang": HangPolicy}
# Typed by canary_settings.py and probe_check.py.
OTHER_SECTIONS = ("canary", "probe", "merge_gate")


def typed_section(cls, where: str, data, least: dict | None = None):
    """`cls` built from the mapping `data`: exactly cls's fields, each a finite number >= 0
    (>= least[key] where given; NaN or inf would be a check that can never fail), an
    integer where the field is one, null where it may be."""
    if not isinstance(data, dict):
        raise UserError(f"{where}: expected a mapping, got {type(data).__name__}")
    types = typing.get_type_hints(cls)
    refuse_unknown_keys(data, types, where)
    missing = sorted(set(types) - set(data))
    if missing:     # only when the shipped file itself lacks a key: a packaging mistake
        raise UserError(f"{where}: missing {missing}; copy them from the shipped "
                        f"manifests/trusted_loss.yaml")
    values = {}
    for key, value in data.items():
        kinds = typing.get_args(types[key]) or (types[key],)
        if value is None and type(None) in kinds:
            values[key] = None
            continue
        low = (least or {}).get(key, 0)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UserError(f"{where}.{key}: expected a number, got {value!r}")
        if not low <= value < math.inf:
            raise UserError(f"{where}.{key}: must be a finite number >= {low}, got {value}")
        if int in kinds and value != int(value):
            raise UserError(f"{where}.{key}: expected an integer, got {value!r}")
        values[key] = int(value) if int in kinds else float(value)
    return cls(**values)


def _peers(data, source: str) -> PeersSpec:
    where = f"{source}: peers"
    if not isinstance(data, dict):
        raise UserError(f"{where}: expected a mapping, got {type(data).__name__}")
    given = dict(data)
    action = given.pop("action", None)
    if action not in PEER_ACTIONS:
        raise UserError(f"{where}.action: must be one of {', '.join(PEER_ACTIONS)}, got "
                        f"{action!r}")
    spec = PeersSpec(**dataclasses.asdict(typed_section(PeersThresholds, where, given)),
                     action=action)
    if not 0 < spec.fraction <= 1:
        raise UserError(f"{where}.fraction: must be in (0, 1], got {spec.fraction:g}")
    if spec.windowLines < 1 or spec.minGpus < 3:
        raise UserError(f"{where}: windowLines must be >= 1 and minGpus >= 3 (a median of "
                        f"peers needs two), got {spec.windowLines} and {spec.minGpus}")
    return spec


def parse_criteria(data: dict, source: str = "criteria") -> Criteria:
    """`data` (a parsed criteria file) over the shipped file's values, typed and checked."""
    data = with_shipped_defaults(data)
    if not isinstance(data, dict):
        raise UserError(f"{source}: expected a mapping with 'checks' and 'supervision'")
    unknown = sorted(set(data) - {"checks", "supervision", "peers", *OTHER_SECTIONS})
    if unknown:
        raise UserError(f"{source}: unknown top-level key(s) {unknown}; known: "
                        f"{['checks', 'supervision', 'peers', *OTHER_SECTIONS]}")
    checks = data.get("checks") or {}
    supervision = data.get("supervision") or {}
    for section, known in (("checks", CHECKS), ("supervision", _SUPERVISION_CLASSES)):
        given = data.get(section) or {}
        if not isinstance(given, dict):
            raise UserError(f"{source}: '{section}' must be a mapping")
        bad = sorted(set(given) - set(known))
        if bad:
            raise UserError(f"{source}: unknown {section} {bad}; known: {sorted(known)}")
    parts = {name: typed_section(cls, f"{source}: checks.{name}", checks.get(name))
             for name, cls in CHECKS.items()}
    parts.update({name: typed_section(cls, f"{source}: supervision.{name}", supervision.get(name))
                  for name, cls in _SUPERVISION_CLASSES.items()})
    return Criteria(**parts, peers=_peers(data.get("peers"), source))
