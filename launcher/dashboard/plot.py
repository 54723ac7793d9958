"""`fractus-pod plot`: the dashboard's curves as one PNG (matplotlib, no display needed):
ema_tf, lb and tok/s per GPU over time, stage windows shaded, markers as vertical lines."""

from __future__ import annotations

import io
from datetime import datetime
from pathlib import Path

from launcher.dashboard.series import CURVES, PodSeries
from launcher.dashboard.timeline import MARKER_COLORS, read_timeline
from launcher.pod.manifest import atomic_write_bytes

DPI = 100
PLOT_POINTS = 4000            # per GPU and curve: more than a 1600-pixel-wide PNG can show
TITLES = {"ema_tf": "ema_tf", "lb": "lb (load balance)", "tok_s": "tok/s"}
GPU_COLORS = ["#1f77b4", "#e377c2", "#8c564b", "#bcbd22", "#17a2b8", "#6f42c1", "#20c997",
              "#fd7e14"]        # the dashboard's (static/dashboard.js)
STAGE_FILLS = ["#4285f4", "#fbbc05", "#34a853", "#ea4335", "#787878"]


def _when(ts: float) -> datetime:
    return datetime.fromtimestamp(ts)


def plot_pod(pod_dir: Path, out: Path, width: int, height: int) -> int:
    """Write the PNG (atomically); returns how many metrics lines it drew from (0: none,
    nothing written)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = PodSeries(pod_dir)
    series.refresh()
    lines = series.metrics_lines
    if not lines:
        return 0
    timeline = read_timeline(pod_dir, series.newest_ts)
    fig, axes = plt.subplots(len(CURVES), 1, sharex=True,
                             figsize=(width / DPI, height / DPI), dpi=DPI)
    try:
        for ax, (name, per_gpu) in zip(axes, series.curves(PLOT_POINTS).items()):
            for window in timeline["stages"]:
                ax.axvspan(_when(window["start"]), _when(window["end"]), alpha=0.08,
                           color=STAGE_FILLS[(window["stage"] - 1) % len(STAGE_FILLS)], lw=0)
            for gpu, (x, y) in per_gpu.items():
                ax.plot([_when(t) for t in x], y, lw=1.2, label=f"gpu{gpu}",
                        color=GPU_COLORS[gpu % len(GPU_COLORS)])
            for marker in timeline["markers"]:
                rollback = marker["kind"] == "rollback"
                ax.axvline(_when(marker["ts"]), color=MARKER_COLORS[marker["kind"]],
                           lw=2.0 if rollback else 1.0, ls="-" if rollback else "--")
            ax.set_title(TITLES[name], loc="left", fontsize=11)
            ax.grid(alpha=0.3)
        axes[0].legend(loc="upper right", ncol=min(8, len(series.gpus)), fontsize=9)
        for window in timeline["stages"]:
            axes[0].annotate(f"stage {window['stage']}", (_when(window["start"]), 1.0),
                             xycoords=("data", "axes fraction"), xytext=(3, -12),
                             textcoords="offset points", fontsize=8, color="#555")
        kinds = sorted({m["kind"] for m in timeline["markers"]})
        if kinds:
            from matplotlib.lines import Line2D
            handles = [Line2D([], [], color=MARKER_COLORS[k], lw=2) for k in kinds]
            axes[-1].legend(handles, [k.replace("_", " ") for k in kinds], loc="upper left",
                            ncol=len(kinds), fontsize=8, title="markers", title_fontsize=8)
        fig.suptitle(f"fractus-pod {pod_dir.name}: {lines:,} metrics lines", fontsize=12)
        fig.autofmt_xdate()
        fig.tight_layout()
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=DPI)
    finally:
        plt.close(fig)
    atomic_write_bytes(out, buffer.getvalue())
    return lines
