"""`fractus-pod report`: a run's summary from its goodput ledger and its incidents, as text
for a terminal or Markdown for the user's notes."""

from __future__ import annotations

from collections import Counter

from launcher.dashboard.goodput import CAUSE_TEXT, CAUSES, duration, hours, pct

# The incidents a summary counts, as the events that record them.
INCIDENTS = {"rollback": "rollbacks", "worker_crash": "worker crashes",
             "hang": "hangs detected", "node_lost": "GPUs that lost their node",
             "gpu_outlier": "GPUs off their peers", "pod_failed": "pod failures"}


def report_rows(ledger: dict, events: list[dict]) -> tuple[list[tuple[str, str]], list, list]:
    """(the run's facts as (name, value), the lost time by cause as rows, one row per GPU)."""
    counts = Counter(e.get("event") for e in events)
    priced = ledger["price_per_gpu_hour"] is not None
    facts = [("launches", str(ledger["sessions"])),
             ("wall time", duration(ledger["wall_s"])),
             ("GPU time", f"{ledger['gpu_hours']:.2f} GPU-h"),
             ("goodput", f"{pct(ledger['goodput'])} ({ledger['trained_gpu_hours']:.2f} "
                         f"GPU-h trained)"),
             ("tokens trained", f"{ledger['tokens_trained']:,}"),
             ("tokens trained again", f"{ledger['tokens_retrained']:,}")]
    if priced:
        facts.append(("cost", f"{ledger['cost']:,.2f} at {ledger['price_per_gpu_hour']:g} "
                              f"per GPU-hour"))
    facts += [(text, str(counts[name])) for name, text in INCIDENTS.items() if counts[name]]
    lost = [(CAUSE_TEXT[c], hours(ledger["lost_s"][c]))
            + ((f"{ledger['lost_cost'][c]:,.2f}",) if priced else ())
            for c in CAUSES if ledger["lost_s"][c] > 0]
    gpus = [(gpu, hours(g["wall_s"]), pct(g["goodput"]), f"{g['tokens_trained']:,}",
             f"{g['tokens_retrained']:,}") for gpu, g in ledger["gpus"].items()]
    return facts, lost, gpus


GPU_HEAD = ("GPU", "time", "goodput", "tokens", "trained again")


def render_text(pod: str, ledger: dict, events: list[dict]) -> str:
    facts, lost, gpus = report_rows(ledger, events)
    lines = [f"run of {pod}"] + _columns(facts)
    if lost:
        lines += ["lost time by cause:"] + _columns(lost)
    if gpus:
        lines += ["per GPU:"] + _columns([GPU_HEAD] + gpus)
    return "\n".join(lines)


def _columns(rows: list) -> list[str]:
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(f"{str(c):<{w}}" for c, w in zip(row, widths)).rstrip()
            for row in rows]


def render_markdown(pod: str, ledger: dict, events: list[dict]) -> str:
    facts, lost, gpus = report_rows(ledger, events)
    priced = ledger["price_per_gpu_hour"] is not None
    lines = [f"## Run of `{pod}`", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in facts]
    if lost:
        lines += ["", "### Lost time by cause", "",
                  "| cause | time |" + (" cost |" if priced else ""),
                  "|---|---|" + ("---|" if priced else "")]
        lines += ["| " + " | ".join(row) + " |" for row in lost]
    if gpus:
        lines += ["", "### Per GPU", "", "| " + " | ".join(GPU_HEAD) + " |",
                  "|" + "---|" * len(GPU_HEAD)]
        lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in gpus]
    return "\n".join(lines) + "\n"
