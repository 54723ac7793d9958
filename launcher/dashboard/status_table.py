"""The per-GPU table of `fractus-pod status`, one line per GPU fitted to the terminal: a
wider terminal never shows fewer columns (columns are kept by priority up to the first that
does not fit; the reason takes the width left).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from rich.table import Table

GAP = 2                   # spaces between columns
REASON_MIN = 16           # narrower than this, a reason says nothing: the column is dropped


def fmt(value, spec: str = "", none: str = "-") -> str:
    if value is None:
        return none
    return format(value, spec) if spec else str(value)


def age(seconds) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    return f"{seconds // 3600}h{(seconds % 3600) // 60:02d}m"


def _pid(r: dict) -> str:
    return f"{r['pid']}{'' if r['alive'] else ' (dead)'}" if r["pid"] else "-"


def _verdict(r: dict) -> str:
    return fmt(r["verdict"]) + (" (last run)" if r["verdict_from_last_run"] else "")


@dataclass(frozen=True)
class Column:
    header: str
    cell: Callable[[dict], str]
    priority: int                  # 0 is kept first; the highest number is dropped first
    right: bool = False            # numbers are right-aligned


def _compile_mark(row: dict) -> str:
    if row.get("compile_fallback"):
        return f" (uncompiled: compile {row['compile_fallback']})"
    return f" (recompiled {row['recompiles']}x)" if row.get("recompiles") else ""


# Display order; priority: what a narrow terminal keeps first.
COLUMNS = (
    Column("GPU", lambda r: str(r["gpu"]), 0, right=True),
    Column("pid", _pid, 13, right=True),
    Column("NODE", lambda r: fmt(r.get("node"))[:12], 11),
    Column("state", lambda r: r["state"] + _compile_mark(r), 1),
    Column("stage", lambda r: fmt(r["stage"]), 5, right=True),
    Column("phase", lambda r: f"{fmt(r.get('phase'))}/{fmt(r.get('phases'))}", 16, right=True),
    Column("next_token", lambda r: fmt(r["next_token"], ","), 3, right=True),
    Column("shard %", lambda r: fmt(r["shard_pct"], ".2f"), 7, right=True),
    Column("ema_tf", lambda r: fmt(r["ema_tf"], ".4f"), 4, right=True),
    Column("ema_ss", lambda r: fmt(r["ema_ss"], ".4f"), 14, right=True),
    Column("lb", lambda r: fmt(r["lb"], ".3f"), 9, right=True),
    Column("tok/s", lambda r: fmt(r["tok_s"], ".0f"), 6, right=True),
    Column("mem GB", lambda r: fmt(r["mem_gb"], ".2f"), 15, right=True),
    Column("ckpt age", lambda r: age(r["checkpoint_age_s"]), 8, right=True),
    Column("hub rev", lambda r: fmt(r["hub_revision"])[:12], 12),
    Column("verdict", _verdict, 2),
    Column("reason", lambda r: fmt(r["reason"]), 10),
)
REASON = COLUMNS[-1]


def _natural_width(column: Column, cells: list[str]) -> int:
    return max([len(column.header)] + [len(c) for c in cells])


def fit_columns(rows: list[dict], width: int | None) -> list[tuple[Column, list[str], int]]:
    """(column, cells, width) in display order; NODE only when a GPU runs on a Ray node."""
    shown = [c for c in COLUMNS
             if c.header != "NODE" or any(r.get("node") for r in rows)]
    cells = {c.header: [c.cell(r) for r in rows] for c in shown}
    natural = {c.header: _natural_width(c, cells[c.header]) for c in shown}
    if width is None:
        return [(c, cells[c.header], natural[c.header]) for c in shown]
    kept: set[str] = set()
    used = -GAP
    for column in sorted(shown, key=lambda c: c.priority):
        need = (min(REASON_MIN, natural[column.header]) if column is REASON
                else natural[column.header])
        if used + GAP + need > width:
            break
        kept.add(column.header)
        used += GAP + need
    widths = {h: natural[h] for h in kept}
    if REASON.header in kept:         # the reason takes what is left, up to its own length
        spare = width - used
        widths[REASON.header] = min(natural[REASON.header],
                                    min(REASON_MIN, natural[REASON.header]) + spare)
    return [(c, cells[c.header], widths[c.header]) for c in shown if c.header in kept]


def gpu_table(rows: list[dict], width: int | None):
    # No borders: a one-space pad each side of a cell (none at the edges) is the GAP.
    table = Table(box=None, pad_edge=False, padding=(0, GAP // 2), header_style="bold",
                  show_header=True)
    fitted = fit_columns(rows, width)
    for column, _, column_width in fitted:
        table.add_column(column.header, justify="right" if column.right else "left",
                         no_wrap=True, overflow="ellipsis", min_width=column_width,
                         max_width=column_width)
    for i in range(len(rows)):
        table.add_row(*(cells[i] for _, cells, _ in fitted))
    return table


def natural_width(rows: list[dict]) -> int:
    fitted = fit_columns(rows, None)
    return sum(w for _, _, w in fitted) + GAP * (len(fitted) - 1)
