"""`merge_rounds:` of the pod config: when the GPUs' weights are merged and how (docs/LAUNCHER.md,
"Merge rounds"). Absent: no rounds, every GPU trains on alone, as before. Parsed once at load
(a mistake: one line, exit 2, nothing written); the supervisor's MergeRounds reads it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from launcher.errors import UserError, check_bool, check_number, optional_section

EVERY_TOKENS_RANGE = (1, 10**15)
QUORUM_RANGE = (1, 4096)
GRACE_RANGE = (0.0, 7 * 86400.0)
WEIGHTS = ("equal", "tokens")
NESTEROV_DEFAULTS = {"lr": 0.7, "momentum": 0.9}     # DiLoCo's outer step
STEPS = ("mean", "nesterov")


@dataclass(frozen=True)
class OuterSettings:
    """The outer step: `mean` (lr 1, momentum 0), or `nesterov` with lr in (0, 2] and
    momentum in [0, 1)."""
    step: str = "mean"
    lr: float = 1.0
    momentum: float = 0.0

    def __post_init__(self):
        if self.step not in STEPS:
            raise ValueError(f"outer step {self.step!r} is not one of {', '.join(STEPS)}")
        for name, value in (("lr", self.lr), ("momentum", self.momentum)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value):
                raise ValueError(f"outer {name} {value!r} is not a finite number")
        if not 0 < self.lr <= 2:
            raise ValueError(f"outer lr {self.lr!r} is not in (0, 2]")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"outer momentum {self.momentum!r} is not in [0, 1)")
        if self.step == "mean" and (self.lr, self.momentum) != (1, 0):
            raise ValueError("outer step `mean` is lr 1 and momentum 0; for others use `nesterov`")

    def to_dict(self) -> dict:
        return {"step": self.step, "lr": float(self.lr), "momentum": float(self.momentum)}

    @classmethod
    def from_dict(cls, d) -> "OuterSettings":
        if not isinstance(d, dict) or set(d) != {"step", "lr", "momentum"}:
            raise ValueError(f"outer settings {d!r} are not {{step, lr, momentum}}")
        return cls(d["step"], d["lr"], d["momentum"])


@dataclass(frozen=True)
class MergeRoundSettings:
    """`every_tokens`: a round each time every GPU trained this many more tokens (None: no
    periodic rounds); `at_stage_end`: a round on the stage's final checkpoints; `outer`:
    the outer step; `weights`: each GPU's delta equal, or by tokens trained since the last
    round; `quorum`: the fewest GPUs a round merges (None: all the launch's GPUs);
    `grace_s`: how long a round waits for the GPUs past the quorum."""
    every_tokens: int | None
    at_stage_end: bool
    outer: OuterSettings
    weights: str
    quorum: int | None
    grace_s: float

    KEYS = ("every_tokens", "at_stage_end", "outer", "lr", "momentum", "weights", "quorum",
            "grace_s")

    @classmethod
    def parse(cls, data, source: str = "merge_rounds") -> "MergeRoundSettings | None":
        data = optional_section(data, cls.KEYS, source,
                                "like {every_tokens: 50000000, outer: nesterov}")
        if data is None:
            return None
        every = data.get("every_tokens")
        if every is not None:
            every = check_number(every, f"{source}.every_tokens", *EVERY_TOKENS_RANGE,
                                 why=" (tokens each GPU trains between two rounds)")
        at_end = check_bool(data.get("at_stage_end", False), f"{source}.at_stage_end")
        if every is None and not at_end:
            raise UserError(f"{source} has no trigger: set every_tokens (e.g. 50000000) "
                            f"and/or at_stage_end: true, or remove the section")
        step = data.get("outer", "mean")
        if step not in ("mean", "nesterov"):
            raise UserError(f"{source}.outer must be mean or nesterov, got {step!r}")
        if step == "mean":
            given = [k for k in ("lr", "momentum") if k in data]
            if given:
                raise UserError(f"{source}.{given[0]} applies to outer: nesterov only (mean "
                                f"is lr 1, momentum 0); remove it or set outer: nesterov")
            outer = OuterSettings()
        else:
            lr = check_number(data.get("lr", NESTEROV_DEFAULTS["lr"]), f"{source}.lr",
                              1e-6, 2.0, kind="a number", why=" (the outer step's size)")
            mu = check_number(data.get("momentum", NESTEROV_DEFAULTS["momentum"]),
                              f"{source}.momentum", 0.0, 0.999, kind="a number",
                              why=" (the outer momentum)")
            outer = OuterSettings("nesterov", float(lr), float(mu))
        weights = data.get("weights", "equal")
        if weights not in WEIGHTS:
            raise UserError(f"{source}.weights must be equal or tokens, got {weights!r}")
        quorum = data.get("quorum")
        if quorum is not None:
            quorum = check_number(quorum, f"{source}.quorum", *QUORUM_RANGE,
                                  why=" (the fewest GPUs a round merges)")
        grace = check_number(data.get("grace_s", 600.0), f"{source}.grace_s", *GRACE_RANGE,
                             kind="a number", why=" (seconds a round waits past its quorum)")
        return cls(every, at_end, outer, weights, quorum, float(grace))

    def quorum_of(self, n_gpus: int) -> int:
        return n_gpus if self.quorum is None else self.quorum

    def to_dict(self) -> dict:
        return {"every_tokens": self.every_tokens, "at_stage_end": self.at_stage_end,
                **self.outer.to_dict(), "weights": self.weights, "quorum": self.quorum,
                "grace_s": self.grace_s}
