"""`fractus-pod plot`: a PNG of the recorded pod's curves, of the asked size, with real
content (each GPU's colour, the rollback marker's), written atomically; nothing to plot is
a one-line error with nothing written."""

from __future__ import annotations

import numpy as np
import pytest
from matplotlib.image import imread

from launcher.cli import main as cli_main
from launcher.dashboard.plot import GPU_COLORS
from launcher.dashboard.timeline import MARKER_COLORS
from tests.support.dashboard import copy_recorded_pod


def _has_colour(image: np.ndarray, hex_colour: str, at_least: int) -> bool:
    rgb = np.array([int(hex_colour[i:i + 2], 16) for i in (1, 3, 5)]) / 255.0
    close = (np.abs(image[:, :, :3] - rgb) < 0.03).all(axis=2)
    return int(close.sum()) >= at_least


def test_plot_writes_the_curves_as_a_png(tmp_path, capsys):
    pod = copy_recorded_pod(tmp_path / "pod")
    out = tmp_path / "report" / "run.png"
    out.parent.mkdir()
    assert cli_main(["--pod-dir", str(pod), "plot", "--out", str(out), "--width", "1200",
                     "--height", "900"]) == 0
    lines = sum(1 for gpu in (0, 1) for line in open(pod / "logs" / f"metrics_gpu{gpu}.jsonl")
                if line.startswith('{"type": "metrics"'))
    assert f"{lines} metrics lines" in capsys.readouterr().out
    image = imread(out)
    assert image.shape[:2] == (900, 1200)
    assert _has_colour(image, GPU_COLORS[0], 500) and _has_colour(image, GPU_COLORS[1], 500)
    assert _has_colour(image, MARKER_COLORS["rollback"], 300)       # the rollback line
    assert len(np.unique(image.reshape(-1, image.shape[2]), axis=0)) > 200
    assert [p.name for p in out.parent.iterdir()] == ["run.png"]   # no temp file left


def test_plot_without_metrics_is_one_line_and_writes_nothing(tmp_path, capsys):
    pod = tmp_path / "pod"
    assert cli_main(["--pod-dir", str(pod), "init", "--no-data"]) == 0
    capsys.readouterr()
    assert cli_main(["--pod-dir", str(pod), "plot", "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no metrics lines" in err
    assert not (tmp_path / "x.png").exists()
    assert cli_main(["--pod-dir", str(pod), "plot", "--out", str(tmp_path / "no" / "x.png")]) == 2
    assert "does not exist" in capsys.readouterr().err


IDLE_GAP_S = 2000.0      # ~33 minutes between two runs, as the pod had


def idle_pod(dest):
    """The recorded pod with its later runs moved 2000 s on: a long idle gap after the
    first run."""
    import json
    pod = copy_recorded_pod(dest)
    third = next(json.loads(line)["ts"] for line in open(pod / "logs" / "events.jsonl")
                 if '"event": "canary"' in line)
    for path in [pod / "logs" / "events.jsonl", *(pod / "logs").glob("metrics_gpu*.jsonl")]:
        lines = []
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record.get("ts", 0) >= third - 5:         # the canary, and after
                record["ts"] += IDLE_GAP_S
            lines.append(json.dumps(record))
        path.write_text("\n".join(lines) + "\n")
    return pod


def _curve_columns(image: np.ndarray) -> float:
    """The share of the top chart's columns that hold a GPU's colour."""
    top = image[: image.shape[0] // 3]
    found = np.zeros(top.shape[1], dtype=bool)
    for colour in GPU_COLORS[:2]:
        rgb = np.array([int(colour[i:i + 2], 16) for i in (1, 3, 5)]) / 255.0
        found |= (np.abs(top[:, :, :3] - rgb) < 0.03).all(axis=2).any(axis=0)
    return found.mean()


def test_an_idle_gap_takes_no_width_on_tokens_and_is_cut_on_time(tmp_path, capsys):
    """Issue 16 item 12: on the wall clock a 33-minute idle gap took 90 % of the width and
    left the runs as slivers. Tokens on x (the default): the gap takes none; `--x time`:
    it is cut to IDLE_DRAWN_S and marked."""
    from launcher.dashboard.series import PodSeries
    from launcher.dashboard.timeline import read_timeline
    from launcher.dashboard.xaxis import IDLE_DRAWN_S, pod_axis
    pod = idle_pod(tmp_path / "pod")
    series = PodSeries(pod)
    series.refresh()
    span = {}
    for mode in ("tokens", "time"):
        axis = pod_axis(series, mode)
        xs = np.concatenate([axis.at(s.columns[0]) for s in series.gpus.values()])
        span[mode] = xs.max() - xs.min()
        assert len(axis.gaps) == 1 and axis.gaps[0]["seconds"] > IDLE_GAP_S
        timeline = read_timeline(pod, series.newest_ts, axis)
        assert len(timeline["runs"]) == 3
        assert [r["x"] for r in timeline["runs"]] == sorted(r["x"] for r in timeline["runs"])
        rollback = next(m for m in timeline["markers"] if m["kind"] == "rollback")
        assert xs.min() < rollback["x"] < xs.max()
    tokens = sum(s.trained()[1][-1] for s in series.gpus.values())
    assert span["tokens"] == pytest.approx(tokens, rel=1e-3)       # the idle time: ~0 tokens
    assert span["time"] < 300 + IDLE_DRAWN_S                       # ~250 s active, not 2250
    for mode in ("tokens", "time"):
        out = tmp_path / f"{mode}.png"
        assert cli_main(["--pod-dir", str(pod), "plot", "--x", mode, "--out", str(out),
                         "--width", "1200", "--height", "900"]) == 0
        # The runs fill the width (~10 % of it on the plain clock): on `time` less, as
        # the pauses under IDLE_S (starts, canaries) stay.
        assert _curve_columns(imread(out)) > {"tokens": 0.8, "time": 0.3}[mode], mode
