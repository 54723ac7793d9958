"""`fractus-pod status` and the dashboard's words as a person reads them (issue 16, items 10
and 11): the table fits 80, 120 and 200 columns with one line per GPU, `--wide` shows every
column in full, an event line cut to the width ends in an ellipsis, the dashboard's markers
round their floats and call the final verdicts what they are."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from launcher.cli.main import main as cli_main
from launcher.config.podconfig import load_pod_config
from launcher.dashboard.status import StatusView, collect
from launcher.dashboard.status_table import COLUMNS
from tests.support.dashboard import copy_recorded_pod

LONG_REASON = ("AR 7.8124 vs baseline 7.7310 (+0.0814, limit 0.2500, floor band 0.25 > k 3 x "
               "noise sigma 0.0412 from the spread 0.0583 of 4 baseline windows); AR at or "
               "below the uniform guess ln(V) 10.83")


@pytest.fixture
def report(tmp_path):
    """The recorded pod's report, as 8 running GPUs with every field at its widest."""
    pod = copy_recorded_pod(tmp_path / "pod")
    report = collect(pod, load_pod_config(pod))
    row = report["gpus"][0]
    report["gpus"] = [{**row, "gpu": gpu, "pid": 4_190_000 + gpu, "alive": True,
                       "node": f"node-{gpu}-a1b2c3d4e5f6", "state": "running",
                       "stage": 3, "next_token": 1_234_567_890, "shard_pct": 45.67,
                       "ema_tf": 3.12345, "ema_ss": 3.23456, "lb": 1.002, "tok_s": 123456.0,
                       "mem_gb": 71.25, "checkpoint_age_s": 7300, "hub_revision": "f" * 40,
                       "verdict": "Successful", "reason": LONG_REASON,
                       "verdict_from_last_run": False} for gpu in range(8)]
    report["events"] = [{"ts": 1_700_000_000 + i, "event": "canary", "gpu": 0,
                         "ar": 1078.066162109375, "rows": list(range(40))} for i in range(3)]
    return report


def _lines(renderable, width: int) -> list[str]:
    out = io.StringIO()
    Console(file=out, width=width, color_system=None).print(renderable)
    return out.getvalue().splitlines()


def _gpu_lines(lines: list[str], gpu: int) -> list[str]:
    return [line for line in lines if line.lstrip().startswith(f"{gpu} ")]


@pytest.mark.parametrize("width", [80, 120, 200])
def test_status_fits_the_width_one_line_per_gpu(report, width):
    lines = _lines(StatusView(report), width)
    too_long = [line for line in lines if len(line) > width]
    assert not too_long, f"{len(too_long)} lines past {width} columns: {too_long[:3]}"
    header = next(line for line in lines if line.lstrip().startswith("GPU"))
    for column in ("GPU", "state", "next_token", "verdict"):   # the first kept, whole words
        assert f" {column} " in f" {header} ", header
    for gpu in range(8):
        assert len(_gpu_lines(lines, gpu)) == 1, (gpu, lines)
        assert "Successful" in _gpu_lines(lines, gpu)[0]
    # Wider terminals show more columns (the reason, cut with an ellipsis).
    kept = [c.header for c in COLUMNS if f" {c.header} " in f" {header} "]
    assert len(kept) >= {80: 6, 120: 10, 200: 14}[width], kept
    if width >= 120:
        assert "\u2026" in _gpu_lines(lines, 0)[0]


def test_wide_shows_every_column_in_full(report):
    view = StatusView(report, wide=True)
    lines = _lines(view, max(80, view.natural_width()))
    header = next(line for line in lines if line.lstrip().startswith("GPU"))
    for column in COLUMNS:
        assert f" {column.header} " in f" {header} ", column.header
    row = _gpu_lines(lines, 3)
    assert len(row) == 1 and row[0].rstrip().endswith(LONG_REASON), row


def test_event_lines_cut_with_an_ellipsis(report):
    lines = _lines(StatusView(report), 100)
    events = [line for line in lines if " canary {" in line]
    assert len(events) == 3
    for line in events:
        assert len(line) <= 100 and line.endswith("\u2026"), line
        assert '"ar": 1078.0662,' in line                     # floats rounded


def test_status_cli_wide_option(tmp_path, capsys):
    pod = copy_recorded_pod(tmp_path / "pod")
    assert cli_main(["--pod-dir", str(pod), "status", "--wide"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.lstrip().startswith("GPU"))
    for column in COLUMNS:
        if column.header != "NODE":          # a pod on one machine has no node column
            assert f" {column.header} " in f" {header} ", column.header


def test_dashboard_markers_round_floats_and_name_final_verdicts():
    from launcher.dashboard.timeline import MARKER_COLORS, markers
    probe, final = markers([
        {"ts": 1.0, "event": "probe", "gpu": 1, "status": "Successful", "ar": 1078.066162109375},
        {"ts": 2.0, "event": "final_verdicts", "stage": 2, "verdicts": {
            "0": {"step": 100, "verdict": "passed"}, "1": {"step": 90, "verdict": "failed"}}}])
    assert probe["label"] == "GPU 1 probe Successful AR=1078.0662"
    assert final["kind"] != "probe" and final["kind"] in MARKER_COLORS
    assert final["label"] == "final verdicts: GPU 0 passed, GPU 1 failed"


def test_rollback_by_hand_leaves_no_stale_verdict_and_names_both_stages(tmp_path, capsys):
    """The recorded pod stopped at stage 2 mid-window ("Incomplete (last run) ... 759/800
    steps"); after `rollback --to-stage 1` that window is no verdict of the pod any more."""
    from launcher.dashboard.timeline import markers
    from launcher.pod.events import read_events
    pod = copy_recorded_pod(tmp_path / "pod")
    before = collect(pod, load_pod_config(pod))
    assert before["gpus"][0]["verdict"] == "Incomplete"
    assert cli_main(["--pod-dir", str(pod), "rollback", "--to-stage", "1"]) == 0
    report = collect(pod, load_pod_config(pod))
    assert report["stage"] == 1
    for row in report["gpus"]:
        assert row["stage"] == 1
        assert row["verdict"] is None and not row["verdict_from_last_run"], row
        assert "no check yet at stage 1" in row["reason"] and "800" not in row["reason"]
    capsys.readouterr()
    assert cli_main(["--pod-dir", str(pod), "status"]) == 0
    assert "Incomplete" not in capsys.readouterr().out
    change = [e for e in read_events(pod) if e["event"] == "stage_change"][-1]
    assert markers([change])[0]["label"] == "stage 2 -> 1"


def test_a_workers_newer_save_is_no_replaced_checkpoint(tmp_path, worker_trained_pod):
    """Issue 16 item 4: `status` while a pod ran warned "does not hold the bytes the
    manifest records ... replaced after the launcher recorded it" in 10 of 25 polls of a
    healthy pod: the worker had saved again (and rotated) between the manifest's write and
    status's read. A real worker saves past the manifest's record here; only bytes that are
    no save of the worker past it (an older checkpoint put back, a copy) still warn."""
    import subprocess

    from launcher.config.devices import Slot
    from launcher.config.stages import load_stages
    from launcher.pod.manifest import read_manifest
    from launcher.worker.process import WorkerSpec, build_env, worker_command
    from tests.support.pods import copy_pod
    pod = copy_pod(worker_trained_pod, tmp_path / "pod")     # trained 3 steps
    config = load_pod_config(pod)
    entry = read_manifest(pod / config.manifest).entries[0]
    live = pod / entry.checkpoint
    recorded_bytes = live.read_bytes()
    assert collect(pod, config)["gpus"][0]["checkpoint_problem"] is None
    # The worker trains on from its file and saves again; the manifest is not rewritten
    # (no launcher reads the event).
    env = build_env(config, WorkerSpec(Slot(0, "cpu"), load_stages(pod / config.stages)[1].settings,
                                       max_steps=6))
    subprocess.run(worker_command(config), cwd=pod, env=env, check=True, capture_output=True,
                   timeout=300)
    assert live.read_bytes() != recorded_bytes
    assert collect(pod, config)["gpus"][0]["checkpoint_problem"] is None
    # Bytes no save of the worker holds are a replacement.
    newer = live.read_bytes()
    live.write_bytes(newer[:-1] + bytes([newer[-1] ^ 1]))
    problem = collect(pod, config)["gpus"][0]["checkpoint_problem"]
    assert problem and "does not hold the bytes the manifest records" in problem
