"""`fractus-pod dashboard` over HTTP (the browser test is test_dashboard_browser.py): what
/api/data holds, downsampling, the unchanged answer, read-only, no token in any answer,
static files only, and the user mistakes (busy port, no pod)."""

from __future__ import annotations

import json
import socket

import numpy as np
import pytest

from launcher.cli import main as cli_main
from launcher.dashboard.series import downsample
from tests.support.dashboard import DashboardProcess, copy_recorded_pod


@pytest.fixture
def pod(tmp_path):
    return copy_recorded_pod(tmp_path / "pod")


@pytest.fixture
def dashboards():
    started = []
    yield started
    for d in started:
        d.stop()


def _metrics(pod, gpu):
    lines = (pod / "logs" / f"metrics_gpu{gpu}.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["type"] == "metrics"]


def _snapshot(root):
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in root.rglob("*") if p.is_file()}


def test_data_holds_every_gpu_curve_markers_stages_and_status(pod, dashboards):
    before = _snapshot(pod)
    dash = DashboardProcess(pod)
    dashboards.append(dash)
    status, body = dash.get("/api/data?points=4000&x=time")
    assert status == 200
    timed = json.loads(body)
    assert timed["x"]["mode"] == "time" and timed["x"]["gaps"] == []   # no pause > IDLE_S
    first = min(json.loads(line)["ts"] for gpu in (0, 1)
                for line in open(pod / "logs" / f"metrics_gpu{gpu}.jsonl"))
    status, body = dash.get("/api/data?points=4000")      # tokens trained on x: the default
    data = json.loads(body)
    assert data["x"]["mode"] == "tokens"
    for gpu in (0, 1):
        records = _metrics(pod, gpu)
        assert data["lines"][str(gpu)] == len(records)
        xs, ys = timed["curves"]["ema_tf"][str(gpu)]
        drawn = [(x, y) for x, y in zip(xs, ys) if y is not None]
        assert drawn == [(pytest.approx(r["ts"] - first, abs=1e-3), pytest.approx(r["ema_tf"]))
                         for r in records]
        xs, ys = data["curves"]["ema_tf"][str(gpu)]
        assert [y for y in ys if y is not None] == pytest.approx([r["ema_tf"] for r in records])
        assert xs == sorted(xs) and len(set(xs)) == len(xs)     # one x per line, growing
        # a worker restart is a gap (null), not a line across the pause
        assert ys.count(None) == sum(1 for line in (pod / "logs" / f"metrics_gpu{gpu}.jsonl")
                                     .read_text().splitlines() if '"event": "start"' in line)
    kinds = {m["kind"] for m in data["markers"]}
    assert {"rollback", "stage", "canary", "hub_push", "verdicts"} <= kinds
    (rollback,) = [m for m in data["markers"] if m["kind"] == "rollback" and m["gpu"] == 1
                   and "rollback" in m["label"]]
    assert rollback["label"] == "GPU 1 rollback stage 3 -> 2"
    assert [w["stage"] for w in data["stages"]] == [1, 2, 3, 2]
    assert all(w["x0"] <= w["x1"] for w in data["stages"]) and len(data["runs"]) == 3
    assert all("x" in m for m in data["markers"])
    assert [r["gpu"] for r in data["status"]["gpus"]] == [0, 1]
    assert data["status"]["gpus"][1]["hub_revision"].startswith("7d0491ed")
    # the unchanged answer while no file moved; a full one after a line is appended
    status, body = dash.get(f"/api/data?version={data['version']}")
    assert json.loads(body) == {"version": data["version"], "unchanged": True}
    with open(pod / "logs" / "metrics_gpu0.jsonl", "a") as f:
        last = _metrics(pod, 0)[-1]
        f.write(json.dumps({**last, "ts": last["ts"] + 1, "step": last["step"] + 2}) + "\n")
    data2 = json.loads(dash.get(f"/api/data?version={data['version']}")[1])
    assert data2["lines"]["0"] == data["lines"]["0"] + 1
    assert len(data2["curves"]["ema_tf"]["0"][0]) == len(data["curves"]["ema_tf"]["0"][0]) + 1
    assert data2["curves"]["ema_tf"]["0"][0][-1] > data["curves"]["ema_tf"]["0"][0][-1]
    after = _snapshot(pod)
    after.pop("logs/metrics_gpu0.jsonl"), before.pop("logs/metrics_gpu0.jsonl")
    assert after == before                 # read-only: nothing else written or touched


def test_no_token_in_any_answer(pod, dashboards):
    secret = "hf_" + "S3cr3tT0k3nAbCdEfGhIjKlMnOpQrStUv"
    env_secret = "plain-env-token-4242"
    with open(pod / "logs" / "events.jsonl", "a") as f:     # a token that slipped into a log
        f.write(json.dumps({"ts": 1e9, "event": "sync_failed", "error": f"401 for {secret} "
                            f"and {env_secret}"}) + "\n")
    state = json.loads((pod / "logs" / "sync_state.json").read_text())
    state["last_error"] = f"Authorization: Bearer {secret}"
    (pod / "logs" / "sync_state.json").write_text(json.dumps(state))
    dash = DashboardProcess(pod, env={"HF_TOKEN": env_secret})
    dashboards.append(dash)
    answers = [dash.get(p)[1] for p in ("/", "/static/dashboard.js", "/static/uPlot.iife.min.js",
                                        "/api/data", "/api/data?points=10")]
    data = json.loads(answers[3])
    assert "sync_failed" in json.dumps(data["status"]["events"])   # the event is shown...
    for body in answers:
        assert secret.encode() not in body and env_secret.encode() not in body  # ...scrubbed


def test_only_shipped_static_files_are_served(pod, dashboards):
    dash = DashboardProcess(pod)
    dashboards.append(dash)
    assert dash.get("/static/uPlot.LICENSE")[0] == 200
    for path in ("/static/../../fractus-pod.yaml", "/static/%2e%2e/server.py",
                 "/fractus-pod.yaml", "/logs/events.jsonl", "/static/"):
        status, body = dash.get(path)
        assert status == 404 and b"model" not in body, path


def test_downsampling_keeps_spikes_last_point_and_breaks():
    n = 100_000
    x = np.arange(n, dtype=float)
    y = np.sin(x / 5000)
    y[31_234] = 50.0                     # a spike
    y[70_000] = np.nan                   # a restart's break
    xs, ys = downsample(x, y, 1000, keep=np.array([70_000]))
    assert len(xs) <= 1002
    assert 50.0 in ys and xs[-1] == n - 1 and np.isnan(ys[xs == 70_000]).all()
    assert (np.diff(xs) > 0).all()


def test_busy_port_and_missing_pod_are_one_line_errors(tmp_path, capsys, pod):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert cli_main(["--pod-dir", str(pod), "dashboard", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--port {port} is in use" in err
    assert cli_main(["--pod-dir", str(tmp_path / "nothing"), "dashboard"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error:")
