"""`fractus-pod plot`: a PNG of the recorded pod's curves, of the asked size, with real
content (each GPU's colour, the rollback marker's), written atomically; nothing to plot is
a one-line error with nothing written."""

from __future__ import annotations

import numpy as np
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
