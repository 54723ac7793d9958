"""The goodput ledger (launcher/dashboard/goodput.py) on synthetic event lists: every second
of a session lands in one bucket, each incident under its own cause, tokens trained again
counted once."""

from __future__ import annotations

import pytest

from launcher.dashboard.goodput import CAUSES, compute_ledger, goodput_line

T0 = 1_000_000.0


def ev(t: float, event: str, **fields) -> dict:
    return {"ts": T0 + t, "event": event, **fields}


def line(t: float, token: int) -> dict:
    return {"type": "metrics", "ts": T0 + t, "next_token": token}


def wevent(t: float, event: str, **fields) -> dict:
    return {"type": "event", "ts": T0 + t, "event": event, **fields}


def incident_run() -> tuple[list[dict], dict[int, list[dict]]]:
    """Two GPUs for 100 s after a 10 s canary. GPU 0: a kill -9 at 30 (last line 25), a hang
    detected at 70 (last line 60), a checkpoint stall of 2 s. GPU 1: rolled back at 50
    (its last line 45) to token 100, re-trains to 400 by 80; a node lost at 90."""
    events = [
        ev(-10, "canary", seconds=10.0, passed=True),
        ev(0, "launch", stage=2, gpus=[0, 1]),
        ev(0, "worker_start", gpu=0, start_token=0),
        ev(0, "worker_start", gpu=1, start_token=0),
        ev(30, "worker_exit", gpu=0, code=-9),
        ev(30, "worker_crash", gpu=0, reason="killed"),
        ev(34, "worker_start", gpu=0, start_token=100),
        ev(70, "hang", gpu=0, silent_s=10),
        ev(70, "worker_crash", gpu=0, reason="hang"),
        ev(72, "worker_start", gpu=0, start_token=500),
        ev(50, "check_failed", gpu=1),
        ev(50, "worker_exit", gpu=1, code=-9),
        ev(51, "rollback", gpu=1, to_token=100),
        ev(53, "worker_start", gpu=1, start_token=100),
        ev(90, "node_lost", gpu=1),
        ev(100, "pod_stopped", reason="SIGTERM received"),
    ]
    metrics = {
        0: [line(5, 0), line(15, 100), wevent(16, "checkpoint", stall_s=2.0), line(25, 200),
            line(40, 100), line(50, 300), line(60, 500),          # 100..200 again
            line(75, 500), line(95, 700)],
        1: [line(5, 0), line(45, 400),
            line(55, 100), line(80, 400), line(85, 500)],          # 100..400 again
    }
    return events, metrics


def test_each_gpu_adds_up_to_the_wall_time_and_names_each_cause():
    events, metrics = incident_run()
    ledger = compute_ledger(events, metrics, price_per_gpu_hour=3.6)
    assert ledger.wall_s == pytest.approx(110.0)          # canary + session
    g0, g1 = ledger.gpus[0], ledger.gpus[1]
    for g in (g0, g1):
        assert g.wall_s == pytest.approx(110.0)
        assert g.trained_s + g.lost_total_s == pytest.approx(g.wall_s)
        assert set(g.lost_s) == set(CAUSES)
    # GPU 0: load 0-5, 30-40, 70-75; trained 5-25 less the 2 s stall, 40-60 half again.
    assert g0.lost_s["canary"] == pytest.approx(10)
    assert g0.lost_s["crash"] == pytest.approx(5)          # 25 -> 30, since its last line
    assert g0.lost_s["load"] == pytest.approx(5 + 10 + 5)
    assert g0.lost_s["checkpoint_stall"] == pytest.approx(2)
    assert g0.lost_s["hang"] == pytest.approx(10)          # 60 -> 70, until detected
    assert g0.lost_s["retrain_crash"] == pytest.approx(5)  # 40->50 trained 100..300, half again
    assert g0.lost_s["stopped"] == pytest.approx(5)        # 95 -> 100, the stop
    assert g0.trained_s == pytest.approx(18 + 5 + 10 + 20)
    assert (g0.tokens_trained, g0.tokens_retrained) == (700, 100)
    # GPU 1: killed for its rollback at 50 (45-50 lost to it), re-trains 100..400 in 55-80.
    assert g1.lost_s["retrain_rollback"] == pytest.approx(5 + 25)
    assert g1.lost_s["load"] == pytest.approx(5 + 5)     # 0-5, the rollback's restart 50-55
    assert g1.lost_s["node_wait"] == pytest.approx(10)
    assert g1.trained_s == pytest.approx(40 + 5)
    assert (g1.tokens_trained, g1.tokens_retrained) == (500, 300)
    assert ledger.money(ledger.gpu_seconds) == pytest.approx(0.22)
    report = ledger.to_dict()
    assert report["lost_s"]["hang"] == pytest.approx(10)
    assert report["gpus"]["1"]["goodput"] == pytest.approx(45 / 110, abs=1e-4)
    line = goodput_line(report)
    assert line.startswith("goodput 44.5% of 0.06 GPU-h (0.22 paid); lost: ") and \
        "restart and model load 30 GPU-s" in line, line


def test_time_between_launches_is_not_paid_and_a_dead_launcher_ends_at_its_last_record():
    events = [ev(0, "launch", gpus=[0]), ev(0, "worker_start", gpu=0, start_token=0),
              # the launcher was killed -9 after its last record at 20; relaunched at 500
              ev(500, "launch", gpus=[0]), ev(500, "worker_start", gpu=0, start_token=100),
              ev(530, "pod_done")]
    metrics = {0: [line(10, 0), line(20, 100), line(510, 100), line(520, 300)]}
    ledger = compute_ledger(events, metrics)
    assert ledger.sessions == 2
    assert ledger.wall_s == pytest.approx(20 + 30)
    g = ledger.gpus[0]
    assert g.trained_s + g.lost_total_s == pytest.approx(50)
    assert g.trained_s == pytest.approx(10 + 10)
    assert g.lost_s["load"] == pytest.approx(10 + 10)
    assert g.lost_s["stopped"] == pytest.approx(10)       # 520 -> 530: done, pod ending


def test_a_running_session_counts_up_to_now():
    events = [ev(0, "launch", gpus=[0]), ev(0, "worker_start", gpu=0, start_token=0)]
    metrics = {0: [line(5, 0), line(15, 100)]}
    assert compute_ledger(events, metrics, now=T0 + 15).wall_s == pytest.approx(15)
    ledger = compute_ledger(events, metrics, now=T0 + 40)
    assert ledger.wall_s == pytest.approx(40)
    assert ledger.gpus[0].trained_s + ledger.gpus[0].lost_total_s == pytest.approx(40)


def test_no_launch_is_an_empty_ledger():
    ledger = compute_ledger([ev(0, "canary", seconds=5)], {})
    assert ledger.gpus == {} and ledger.wall_s == 0 and ledger.goodput is None
    assert "no launch" in goodput_line(ledger.to_dict())


@pytest.fixture
def recorded(tmp_path):
    """A pod whose files hold incident_run(), priced at 3.6 per GPU-hour."""
    import json

    import yaml

    from launcher.pod.setup_init import init_pod
    from launcher.paths import EVENTS_FILE, metrics_path
    pod = tmp_path / "pod"
    init_pod(pod, "tiny-cpu")
    config = yaml.safe_load((pod / "fractus-pod.yaml").read_text())
    (pod / "fractus-pod.yaml").write_text(yaml.safe_dump({**config, "price_per_gpu_hour": 3.6}))
    events, metrics = incident_run()
    (pod / "logs").mkdir(exist_ok=True)
    (pod / EVENTS_FILE).write_text("".join(json.dumps(e) + "\n" for e in events))
    for gpu, records in metrics.items():
        (pod / metrics_path(gpu)).write_text("".join(json.dumps(r) + "\n" for r in records))
    return pod


def test_status_shows_one_line_and_its_json_all_of_the_ledger(recorded, capsys):
    import json

    from launcher.cli import main as cli_main
    assert cli_main(["--pod-dir", str(recorded), "status", "--json"]) == 0
    ledger = json.loads(capsys.readouterr().out)["goodput"]
    assert ledger["cost"] == pytest.approx(0.22) and ledger["lost_s"]["hang"] == 10
    assert ledger["gpus"]["0"]["lost_s"]["crash"] == 5
    assert cli_main(["--pod-dir", str(recorded), "status"]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("goodput ")]
    assert len(lines) == 1 and "(0.22 paid)" in lines[0], lines


def test_report_as_text_and_markdown(recorded, capsys):
    from launcher.cli import main as cli_main
    assert cli_main(["--pod-dir", str(recorded), "report"]) == 0
    text = capsys.readouterr().out
    import re
    for row in (r"goodput +44\.5%", r"hangs detected +1\n", r"hang until detected +10 GPU-s +0\.01",
                r"GPU +time +goodput", r"\n +1 +110 GPU-s +40\.9% +500 +300\n"):
        assert re.search(row, text), (row, text)
    assert cli_main(["--pod-dir", str(recorded), "report", "--markdown"]) == 0
    markdown = capsys.readouterr().out
    assert "| cost | 0.22 at 3.6 per GPU-hour |" in markdown
    assert "| waiting for a node | 10 GPU-s | 0.01 |" in markdown
    assert "| 1 | 110 GPU-s | 40.9% | 500 | 300 |" in markdown, markdown
