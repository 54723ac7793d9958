"""Checks of the goodput ledger (launcher/dashboard/goodput.py) on a pod a real launcher ran."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.dashboard.goodput import Ledger
from launcher.dashboard.goodput_files import pod_ledger
from launcher.pod.events import read_events
from launcher.worker.process import read_records
from launcher.paths import metrics_path


def metrics_lines(pod: Path, gpu: int) -> list[dict]:
    return [r for r in read_records(pod / metrics_path(gpu)) if r.get("type") == "metrics"]


def assert_ledger_adds_up(pod: Path) -> Ledger:
    """The ledger of an ended pod with one launch: the pod's wall time is the launcher's
    (its start-up checks before the launch event, to its `launch_end`); every GPU's trained + lost time is that wall time; the tokens each restart trained
    again are those its worker repeated (from its start event's token to where the run
    before it had logged)."""
    ledger = pod_ledger(pod)
    events = read_events(pod)
    (launch,) = [e for e in events if e["event"] == "launch"]
    (end,) = [e for e in events if e["event"] == "launch_end"] or \
        [e for e in events if e["event"] in ("pod_stopped", "pod_done", "pod_failed")][:1]
    assert launch["startup_s"] > 0
    assert ledger.wall_s == pytest.approx(end["ts"] - launch["ts"] + launch["startup_s"])
    for gpu, led in ledger.gpus.items():
        assert led.wall_s == pytest.approx(ledger.wall_s), gpu
        assert led.trained_s + led.lost_total_s == pytest.approx(led.wall_s), gpu
        assert led.trained_s > 0 and led.lost_s["load"] > 0, gpu
        starts = [r for r in read_records(pod / metrics_path(gpu)) if r.get("event") == "start"]
        lines, again = metrics_lines(pod, gpu), 0
        for start in starts[1:]:
            reached = max([r["next_token"] for r in lines if r["ts"] < start["ts"]], default=0)
            again += max(0, reached - start["next_token"])
        assert led.tokens_retrained == again, gpu
    return ledger
