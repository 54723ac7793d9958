"""`fractus-pod plot`: the dashboard's curves as one PNG (matplotlib Agg, no display)."""

from __future__ import annotations

import io
import time
from pathlib import Path

from launcher.dashboard.series import CURVES, PodSeries
from launcher.dashboard.timeline import MARKER_COLORS, read_timeline
from launcher.dashboard.xaxis import X_MODES, idle, pod_axis
from launcher.files import atomic_write_bytes

DPI = 100
PLOT_POINTS = 4000            # per GPU and curve: more than a 1600-pixel-wide PNG can show
TITLES = {"ema_tf": "ema_tf", "lb": "lb (load balance)", "tok_s": "tok/s"}
GPU_COLORS = ["#1f77b4", "#e377c2", "#8c564b", "#bcbd22", "#17a2b8", "#6f42c1", "#20c997",
              "#fd7e14"]        # the dashboard's (static/dashboard.js)
STAGE_FILLS = ["#4285f4", "#fbbc05", "#34a853", "#ea4335", "#787878"]


def _x_formatter(axis):
    """Tick labels: the clock on a `time` axis, token counts (12.3k, 1.20M) otherwise."""
    from matplotlib.ticker import EngFormatter, FuncFormatter   # as plot_pod: matplotlib when drawing
    if axis.mode == "time":
        return FuncFormatter(lambda x, _pos: time.strftime("%H:%M:%S",
                                                           time.localtime(axis.clock(x))))
    return EngFormatter(sep="")


def plot_pod(pod_dir: Path, out: Path, width: int, height: int,
             x_mode: str = X_MODES[0]) -> int:
    """Write the PNG atomically; returns the metrics lines drawn (0: nothing written)."""
    # matplotlib (~0.3 s) and its backend (Agg: no display) chosen when a plot is drawn, not
    # as a side effect of importing this module.
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = PodSeries(pod_dir)
    series.refresh()
    lines = series.metrics_lines
    if not lines:
        return 0
    axis = pod_axis(series, x_mode)
    timeline = read_timeline(pod_dir, series.newest_ts, axis)
    fig, axes = plt.subplots(len(CURVES), 1, sharex=True,
                             figsize=(width / DPI, height / DPI), dpi=DPI)
    try:
        for ax, (name, per_gpu) in zip(axes, series.curves(PLOT_POINTS).items()):
            for window in timeline["stages"]:
                ax.axvspan(window["x0"], window["x1"], alpha=0.08,
                           color=STAGE_FILLS[(window["stage"] - 1) % len(STAGE_FILLS)], lw=0)
            for run in timeline["runs"]:
                ax.axvline(run["x"], color="#999", lw=0.8, ls=":")
            for gap in axis.gaps:
                ax.axvline(gap["x"], color="#bbb", lw=4, alpha=0.5)
            for gpu, (ts, y) in per_gpu.items():
                ax.plot(axis.at(ts), y, lw=1.2, label=f"gpu{gpu}",
                        color=GPU_COLORS[gpu % len(GPU_COLORS)])
            for marker in timeline["markers"]:
                rollback = marker["kind"] == "rollback"
                ax.axvline(marker["x"], color=MARKER_COLORS[marker["kind"]],
                           lw=2.0 if rollback else 1.0, ls="-" if rollback else "--",
                           zorder=3 if rollback else 2)    # on top of a stage change
            ax.set_title(TITLES[name], loc="left", fontsize=11)
            ax.grid(alpha=0.3)
        axes[0].legend(loc="upper right", ncol=min(8, len(series.gpus)), fontsize=9)
        # Stage labels at the bottom, run and idle labels at the top: clear of the legend.
        for window in timeline["stages"]:
            axes[0].annotate(f"stage {window['stage']}", (window["x0"], 0.0),
                             xycoords=("data", "axes fraction"), xytext=(3, 4),
                             textcoords="offset points", fontsize=8, color="#555")
        for i, run in enumerate(timeline["runs"]):
            axes[0].annotate(f"run {i + 1}", (run["x"], 1.0), xycoords=("data", "axes fraction"),
                             xytext=(3, -12), textcoords="offset points", fontsize=8,
                             color="#777")
        for gap in axis.gaps:
            axes[0].annotate(idle(gap["seconds"]), (gap["x"], 1.0),
                             xycoords=("data", "axes fraction"), xytext=(4, -24),
                             textcoords="offset points", fontsize=8, color="#555")
        axes[-1].xaxis.set_major_formatter(_x_formatter(axis))
        axes[-1].set_xlabel(axis.label)
        kinds = sorted({m["kind"] for m in timeline["markers"]})
        if kinds:
            from matplotlib.lines import Line2D
            handles = [Line2D([], [], color=MARKER_COLORS[k], lw=2) for k in kinds]
            axes[-1].legend(handles, [k.replace("_", " ") for k in kinds], loc="upper left",
                            ncol=len(kinds), fontsize=8, title="markers", title_fontsize=8)
        fig.suptitle(f"fractus-pod {pod_dir.name}: {lines:,} metrics lines", fontsize=12)
        fig.tight_layout()
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=DPI)
    finally:
        plt.close(fig)
    atomic_write_bytes(out, buffer.getvalue())
    return lines
