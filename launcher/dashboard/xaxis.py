"""The x axis of the plot and the dashboard: idle time takes (almost) no width. x is the
tokens the pod trained (default), or the clock with each idle gap cut to IDLE_DRAWN_S;
both one increasing time -> x map, so curves, markers and stage windows share it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from launcher.dashboard.series import PodSeries

X_MODES = ("tokens", "time")
IDLE_S = 120.0           # no metrics line from any GPU for longer: the pod was idle
IDLE_DRAWN_S = 20.0      # an idle gap's width on the `time` axis
# Tokens per idle second: x grows strictly with time, so no two moments share an x
# (the dashboard joins the GPUs' points by x) and no width goes to the idle time.
TIE_BREAK = 1e-3
MAX_KNOTS = 20_000
FAR_S = 1e9              # the time map goes on at slope 1 before and after the data


@dataclass(frozen=True)
class XAxis:
    mode: str
    label: str
    knots_ts: np.ndarray     # increasing times ...
    knots_x: np.ndarray      # ... and their x (non-decreasing)
    gaps: tuple[dict, ...]   # each idle gap: {"x": where it is, "seconds": how long it was}

    def at(self, ts) -> np.ndarray:
        return np.interp(np.asarray(ts, dtype=np.float64), self.knots_ts, self.knots_x)

    def clock(self, x) -> np.ndarray:
        """The time at `x` (the `time` axis' tick labels)."""
        return np.interp(np.asarray(x, dtype=np.float64), self.knots_x, self.knots_ts)

    def knots(self) -> list[list[float]]:
        """[x, ts] pairs the page inverts to label a `time` axis with the clock."""
        return [[float(x), float(t)] for x, t in zip(self.knots_x, self.knots_ts)]


def _idle_gaps(ts: np.ndarray) -> list[tuple[float, float]]:
    if len(ts) < 2:
        return []
    apart = np.flatnonzero(np.diff(ts) > IDLE_S)
    return [(float(ts[i]), float(ts[i + 1])) for i in apart]


def _thin(ts: np.ndarray, x: np.ndarray, keep: list[float]) -> tuple[np.ndarray, np.ndarray]:
    """At most about MAX_KNOTS knots (the ends and the times in `keep` always)."""
    if len(ts) <= MAX_KNOTS:
        return ts, x
    index = np.unique(np.concatenate([np.linspace(0, len(ts) - 1, MAX_KNOTS).astype(np.int64),
                                      np.searchsorted(ts, keep).clip(0, len(ts) - 1)]))
    return ts[index], x[index]


def pod_axis(series: PodSeries, mode: str) -> XAxis:
    per_gpu = [s.trained() for s in series.gpus.values() if len(s)]
    ts = np.concatenate([t for t, _ in per_gpu]) if per_gpu else np.zeros(1)
    order = np.argsort(ts, kind="stable")
    ts = ts[order]
    gaps = _idle_gaps(ts)
    if mode == "tokens":
        # Each GPU's tokens trained, as steps at its lines' times, summed over the pod.
        grown = np.concatenate([np.diff(np.concatenate([[0.0], tokens]))
                                for _, tokens in per_gpu]) if per_gpu else np.zeros(1)
        x = np.cumsum(grown[order]) + TIE_BREAK * (ts - ts[0])
        knots_ts, knots_x = _thin(ts, x, [t for gap in gaps for t in gap])
        marks = [{"x": float(np.interp(start, knots_ts, knots_x)), "seconds": end - start}
                 for start, end in gaps]
        return XAxis(mode, "tokens trained (all GPUs)", knots_ts, knots_x, tuple(marks))
    if mode != "time":
        raise ValueError(f"x mode {mode!r}: expected one of {X_MODES}")
    # Slope 1 everywhere except across an idle gap, which is drawn IDLE_DRAWN_S wide.
    knots_ts, knots_x, marks, cut = [ts[0] - FAR_S], [-FAR_S], [], 0.0
    for start, end in gaps:
        knots_ts += [start, end]
        knots_x += [start - ts[0] - cut, start - ts[0] - cut + IDLE_DRAWN_S]
        marks.append({"x": start - ts[0] - cut + IDLE_DRAWN_S / 2, "seconds": end - start})
        cut += end - start - IDLE_DRAWN_S
    knots_ts.append(ts[-1] + FAR_S)
    knots_x.append(ts[-1] + FAR_S - ts[0] - cut)
    return XAxis(mode, "time (idle gaps cut)", np.array(knots_ts), np.array(knots_x),
                 tuple(marks))


def idle(seconds: float) -> str:
    seconds = int(seconds)
    return (f"idle {seconds // 60}m" if seconds < 7200
            else f"idle {seconds // 3600}h{(seconds % 3600) // 60:02d}m")
