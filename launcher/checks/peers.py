"""Each GPU judged against its peers: a straggler (slow) or a loss outlier (off the pack).

Catches what a GPU's own checks pass (30 % slower than its peers, a loss drifting inside
its own band). Leave-one-out medians; the loss outlier's deviation is 1.4826 x MAD (one
normal sigma; median and MAD ignore one bad peer where mean and std would not). A GPU's
window restarts with its worker (the first lines after a load are not its speed).
Thresholds: docs/LAUNCHER.md "Health checks", **Peers**.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from launcher.checks.criteria import PeersSpec

STRAGGLER, LOSS = "straggler", "loss"
MAD_TO_SIGMA = 1.4826


@dataclass(frozen=True)
class Outlier:
    gpu: int
    kind: str            # STRAGGLER or LOSS
    value: float         # its tok_s median, or its ema_tf
    median: float        # its peers'
    threshold: float     # the bar it crossed: fraction x median, or k robust deviations
    window: int          # metrics lines per GPU

    def event_fields(self) -> dict:
        return {"gpu": self.gpu, "kind": self.kind, "value": round(self.value, 4),
                "median": round(self.median, 4), "threshold": round(self.threshold, 4),
                "window": self.window}

    def mark(self) -> str:
        if self.kind == STRAGGLER:
            return (f"straggler: {self.value:,.0f} tok/s, below {self.threshold:,.0f} "
                    f"(peers' median {self.median:,.0f})")
        return (f"loss outlier: ema_tf {self.value:.4f}, peers' median {self.median:.4f} "
                f"(limit +/-{self.threshold:.4f})")


def _finite(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


class PeersCheck:
    def __init__(self, spec: PeersSpec):
        self.spec = spec
        self.speed: dict[int, deque] = {}
        self.loss: dict[int, float] = {}

    def restart(self, gpu: int) -> None:
        self.speed.pop(gpu, None)
        self.loss.pop(gpu, None)

    def feed(self, gpu: int, record: dict) -> None:
        tok_s, ema_tf = _finite(record.get("tok_s")), _finite(record.get("ema_tf"))
        if tok_s is not None:
            self.speed.setdefault(gpu, deque(maxlen=self.spec.windowLines)).append(tok_s)
        if ema_tf is not None:
            self.loss[gpu] = ema_tf

    def judge(self) -> list[Outlier]:
        """The GPUs off their peers now (empty below minGpus full windows)."""
        spec = self.spec
        speeds = {g: statistics.median(w) for g, w in self.speed.items()
                  if len(w) == spec.windowLines}
        found = []
        if len(speeds) >= spec.minGpus:
            for gpu, mine in speeds.items():
                median = statistics.median(v for g, v in speeds.items() if g != gpu)
                if mine < spec.fraction * median:
                    found.append(Outlier(gpu, STRAGGLER, mine, median,
                                         spec.fraction * median, spec.windowLines))
        # Loss: the GPUs with a full window (their newest ema_tf is past their load).
        losses = {g: v for g, v in self.loss.items() if g in speeds}
        if len(losses) >= spec.minGpus:
            for gpu, mine in losses.items():
                others = [v for g, v in losses.items() if g != gpu]
                median = statistics.median(others)
                mad = statistics.median(abs(v - median) for v in others)
                limit = spec.k * max(MAD_TO_SIGMA * mad, spec.minDeviation)
                if abs(mine - median) > limit:
                    found.append(Outlier(gpu, LOSS, mine, median, limit, spec.windowLines))
        return found
