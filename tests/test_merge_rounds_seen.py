"""Merge rounds seen everywhere, from files in the shared formats this test writes (no
orchestration): `status`'s line and its JSON (launcher/dashboard/merge_status.py), the
goodput bucket `merge_round`, the dashboard's markers and status line, TensorBoard's and
trackio's scalars of a `merge_round` event."""

from __future__ import annotations

import json

import pytest
import yaml

from launcher.dashboard.goodput import CAUSES, compute_ledger
from launcher.dashboard.goodput_files import pod_ledger
from launcher.dashboard.merge_status import rounds_report
from launcher.dashboard.timeline import MARKER_COLORS, markers
from launcher.paths import EVENTS_FILE, ROUNDS_LEDGER, TENSORBOARD_RUN, metrics_path

T0 = 1_000_000.0


def at(t: float, **fields) -> dict:
    """A record at T0 + t (a launcher event: event=...)."""
    return {"ts": T0 + t, **fields}


def m(t: float, token: int) -> dict:
    """A worker's metrics line."""
    return at(t, type="metrics", next_token=token)


def w(t: float, event: str, **fields) -> dict:
    """A worker's event in its METRICS file."""
    return at(t, type="event", event=event, **fields)


def write_jsonl(path, records) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def a_round(n: int, state: str, boundary, gpus, left_out=(), reason="") -> dict:
    return {"round": n, "stage": 3, "boundary": boundary, "state": state,
            "gpus": {str(g): {"at_token": 1000 * n, "checkpoint": f"checkpoints/g{g}.pt",
                              "sha256": "0" * 64, "tokens": 1000} for g in gpus},
            "left_out": list(left_out), "weights": [1.0 / len(gpus)] * len(gpus),
            "outer": {"step": "nesterov", "lr": 0.7, "momentum": 0.9},
            "merged": f"merge/round_{n:05d}.pt", "merged_sha256": None, "gate": None,
            "reason": reason, "seconds": 12.5}


def write_ledger(pod, rounds, origins=None) -> None:
    path = pod / ROUNDS_LEDGER
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"format": "fractus-pod-rounds-v1",
                                "origins": origins or {"3": {"0": 100, "1": 200}},
                                "rounds": rounds}))


@pytest.fixture
def settings() -> dict:
    """The pod's `merge_rounds:` section; a test changes it in place."""
    return {"every_tokens": 1000, "at_stage_end": True}


@pytest.fixture
def pod(tmp_path, monkeypatch, settings):
    """A 2-GPU pod at stage 3 whose config has `settings` as `merge_rounds:` (set on the
    loaded config: its parsing is the config's, not this test's)."""
    from launcher.config import podconfig
    from launcher.pod.manifest import Manifest, ManifestEntry, write_manifest
    from launcher.pod.setup_init import init_pod
    pod = tmp_path / "pod"
    init_pod(pod, "tiny-cpu")
    config = yaml.safe_load((pod / "fractus-pod.yaml").read_text())
    write_manifest(Manifest(pod / config["manifest"],     # status's stage comes from it
                            {g: ManifestEntry(start_token=1000, stage=3) for g in (0, 1)}))
    loaded = podconfig.load_pod_config

    def with_rounds(pod_dir):
        config = loaded(pod_dir)
        config.merge_rounds = settings
        return config
    monkeypatch.setattr("launcher.cli.view.load_pod_config", with_rounds)
    return pod


def status(pod, capsys, *flags) -> tuple[int, str]:
    from launcher.cli import main as cli_main
    code = cli_main(["--pod-dir", str(pod), "status", *flags])
    return code, capsys.readouterr().out


def merge_lines(out: str) -> list[str]:
    return [x for x in out.splitlines() if x.startswith("merge rounds:")]


# ---- status ------------------------------------------------------------------------------

def test_status_shows_the_last_round_who_was_left_out_and_the_next_rounds_tokens(pod, capsys):
    code, out = status(pod, capsys)
    assert code == 0 and merge_lines(out) == []          # no ledger: no rounds, no line
    write_ledger(pod, [a_round(1, "adopted", 1, [0, 1]),
                       a_round(2, "adopted", 2, [0], left_out=[1])])
    code, out = status(pod, capsys, "--json")
    rounds = json.loads(out)["merge_rounds"]
    assert code == 0 and rounds["error"] is None
    assert (rounds["last"]["round"], rounds["last"]["state"]) == (2, "adopted")
    assert rounds["last"]["left_out"] == [1]
    # origins + k * every_tokens, k the boundary after round 2's (2)
    assert rounds["next_tokens"] == {"0": 100 + 3 * 1000, "1": 200 + 3 * 1000}
    code, out = status(pod, capsys)
    assert code == 0
    assert merge_lines(out) == ["merge rounds: round 2 adopted (1/2 GPUs, gpu1 left out); "
                                "next at gpu0@3,100 gpu1@3,200"], out


def test_status_shows_a_refused_round_with_its_reason_and_a_stage_end_round(pod, capsys,
                                                                            settings):
    settings.update(every_tokens=None)             # rounds at the stage's end only
    write_ledger(pod, [a_round(1, "adopted", None, [0, 1]),
                       a_round(2, "refused", None, [0, 1],
                               reason="gate: merged loss 0.31 above gpu0's own")])
    code, out = status(pod, capsys)
    assert code == 0
    assert merge_lines(out) == ["merge rounds: round 2 refused: gate: merged loss 0.31 above "
                                "gpu0's own; next at the stage's end"], out
    rounds = json.loads(status(pod, capsys, "--json")[1])["merge_rounds"]
    assert rounds["last"]["state"] == "refused" and rounds["next_tokens"] is None
    assert rounds["next_at"] == "stage_end"


@pytest.mark.parametrize("ledger", [
    "{not json",
    json.dumps({"format": "some-other-v9", "origins": {}, "rounds": []}),
    json.dumps({"format": "fractus-pod-rounds-v1", "origins": {}, "rounds": [{"round": -1}]}),
    json.dumps({"format": "fractus-pod-rounds-v1", "origins": {"3": {"0": "100"}},
                "rounds": []}),
    json.dumps({"format": "fractus-pod-rounds-v1", "origins": {},
                "rounds": [{**a_round(1, "adopted", True, [0]), "boundary": True}]}),
    json.dumps({"format": "fractus-pod-rounds-v1", "origins": {},
                "rounds": [{**a_round(1, "adopted", 0, [0]), "gpus": {"gpu0": {}}}]}),
    json.dumps({"format": "fractus-pod-rounds-v1", "origins": {},
                "rounds": [a_round(1, "maybe", 0, [0])]}),
])
def test_a_malformed_ledger_is_one_line_and_status_still_works(pod, capsys, ledger):
    (pod / ROUNDS_LEDGER).parent.mkdir(parents=True, exist_ok=True)
    (pod / ROUNDS_LEDGER).write_text(ledger)
    code, out = status(pod, capsys)
    assert code == 0
    (found,) = merge_lines(out)
    assert found.startswith("merge rounds: merge/rounds.json "), found
    assert any(x.startswith("goodput") for x in out.splitlines())     # the rest is there
    code, out = status(pod, capsys, "--json")
    report = json.loads(out)
    assert code == 0 and report["merge_rounds"]["error"] and report["gpus"]


def test_a_round_in_progress_counts_the_gpus_waiting_at_its_boundary(tmp_path):
    from types import SimpleNamespace
    write_ledger(tmp_path, [a_round(1, "adopted", 1, [0, 1, 2, 3]),
                            a_round(2, "adopted", 1, [0, 1, 2, 3]),
                            a_round(3, "adopted", 2, [0, 1, 2, 3]),
                            a_round(4, "merging", 3, [0, 1, 2])],
                 origins={"3": {str(g): 0 for g in range(4)}})
    for gpu in range(3):          # three paused at the boundary, the fourth still training
        write_jsonl(tmp_path / metrics_path(gpu),
                    [m(10, 4000), w(11, "merge_wait", boundary=3, next_token=4000)])
    write_jsonl(tmp_path / metrics_path(3), [w(5, "merge_adopted", round=3,
                                                    at_token=3000, waited_s=2.0),
                                             m(10, 3900)])
    config = SimpleNamespace(merge_rounds=SimpleNamespace(every_tokens=1000))
    report = rounds_report(tmp_path, config, 3, [0, 1, 2, 3], {"started_at": T0})
    assert report["in_progress"] == {"round": 4, "waiting": [0, 1, 2], "gpus": 4}
    assert report["line"] == ("merge rounds: round 3 adopted (4/4 GPUs); round 4 merging: "
                              "3/4 GPUs waiting; next at gpu0@4,000 gpu1@4,000 gpu2@4,000 "
                              "gpu3@4,000")
    # No launcher running: nothing waits, the round is not decided yet.
    stopped = rounds_report(tmp_path, config, 3, [0, 1, 2, 3], None)
    assert "round 4 merging, not decided" in stopped["line"]
    # No `merge_rounds:` section: no next token to show.
    off = rounds_report(tmp_path, SimpleNamespace(), 3, [0, 1, 2, 3], None)
    assert off["next_tokens"] is None and "next at" not in off["line"]


# ---- goodput -----------------------------------------------------------------------------

def merge_run() -> tuple[list[dict], dict[int, list[dict]]]:
    """Two GPUs for 100 s. GPU 0 waits 20 s in round 1 (16 -> 36), after a 1 s save. GPU 1
    waits from 21, killed at 30 in its wait (a crash), restarts; waits 10 s in round 2 and is
    left out (56 -> 66)."""
    events = [at(0, event="launch", stage=3, gpus=[0, 1]),
              at(0, event="worker_start", gpu=0, start_token=0),
              at(0, event="worker_start", gpu=1, start_token=0),
              at(30, event="worker_exit", gpu=1, code=-9),
              at(30, event="worker_crash", gpu=1, reason="killed"),
              at(32, event="worker_start", gpu=1, start_token=150),
              at(36, event="merge_round", round=1, stage=3, boundary=0, verdict="adopted",
                 quorum=[0], left_out=[1], seconds=20.0),
              at(66, event="merge_round", round=2, stage=3, boundary=1, verdict="refused",
                 quorum=[0, 1], left_out=[], reason="gate", seconds=10.0),
              at(100, event="pod_stopped", reason="SIGTERM received")]
    metrics = {
        0: [m(5, 0), m(15, 100), w(16, "checkpoint", stall_s=1.0),
            w(16, "merge_wait", boundary=0, next_token=100),
            w(36, "merge_adopted", round=1, at_token=100, step=10, waited_s=20.0),
            m(40, 200), m(60, 400), m(95, 700)],
        1: [m(5, 0), m(20, 150), w(21, "merge_wait", boundary=0, next_token=150),
            m(40, 150), m(55, 300), w(56, "merge_wait", boundary=1, next_token=300),
            w(66, "merge_skipped", round=2, boundary=1, reason="refused", waited_s=10.0),
            m(70, 400), m(95, 700)],
    }
    return events, metrics


def check_merge_buckets(ledger) -> None:
    g0, g1 = ledger.gpus[0], ledger.gpus[1]
    for g in (g0, g1):
        assert set(g.lost_s) == set(CAUSES)
        assert g.wall_s == pytest.approx(100.0)
        assert g.trained_s + g.lost_total_s == pytest.approx(g.wall_s)
    assert g0.lost_s["merge_round"] == pytest.approx(20)        # its waited_s
    assert g0.lost_s["checkpoint_stall"] == pytest.approx(1)
    assert g0.trained_s == pytest.approx(10 + 4 + 20 + 35)      # 15 -> 40 less wait and save
    # GPU 1: 21 -> 30 cut short by its crash (counted until the exit), then 10 s left out.
    assert g1.lost_s["merge_round"] == pytest.approx(9 + 10)
    assert g1.lost_s["crash"] == pytest.approx(1)                # 20 -> 21, before its wait
    assert g1.lost_s["load"] == pytest.approx(5 + 10)
    assert g1.trained_s == pytest.approx(15 + 15 + 5 + 25)
    assert ledger.to_dict()["lost_s"]["merge_round"] == pytest.approx(39)


def test_time_in_a_round_is_its_own_goodput_bucket_and_every_gpu_still_sums(tmp_path):
    events, metrics = merge_run()
    check_merge_buckets(compute_ledger(events, metrics))
    # The same from the pod's files (the worker's records read by goodput_files.py).
    write_jsonl(tmp_path / EVENTS_FILE, events)
    for gpu, records in metrics.items():
        write_jsonl(tmp_path / metrics_path(gpu), records)
    check_merge_buckets(pod_ledger(tmp_path))


# ---- dashboard ---------------------------------------------------------------------------

def test_dashboard_marks_each_round_adopted_or_refused_and_shows_the_status_line(pod):
    from launcher.config.podconfig import load_pod_config
    from launcher.dashboard.server import DashboardData
    events, metrics = merge_run()
    found = markers(events)
    assert [(m["kind"], m["label"]) for m in found if m["kind"].startswith("merge")] == [
        ("merge", "round 1 adopted: 1 GPU (gpu1 left out), 20 s"),
        ("merge_refused", "round 2 refused: gate")]
    assert {"merge", "merge_refused"} <= set(MARKER_COLORS)
    assert MARKER_COLORS["merge"] != MARKER_COLORS["merge_refused"]
    write_jsonl(pod / EVENTS_FILE, events)
    for gpu, records in metrics.items():
        write_jsonl(pod / metrics_path(gpu), records)
    write_ledger(pod, [a_round(1, "adopted", 1, [0], left_out=[1])])
    data = DashboardData(pod, load_pod_config(pod)).payload(100)
    assert [m["kind"] for m in data["markers"]] == ["restart", "merge", "merge_refused"]
    assert all(isinstance(m["x"], float) for m in data["markers"])
    assert data["status"]["merge_rounds"]["line"].startswith(
        "merge rounds: round 1 adopted (1/2 GPUs, gpu1 left out)")
    assert data["status"]["goodput"]["lost_s"]["merge_round"] > 0


# ---- TensorBoard and trackio -------------------------------------------------------------

ADOPTED = dict(round=1, stage=3, boundary=0, verdict="adopted", quorum=[0, 1], left_out=[],
               at_tokens={"0": 1000, "1": 1000},
               gate={"gpus": {"0": {"rise": 0.012}, "1": {"rise": -0.003}}},
               reason="gate passed", seconds=41.0, outer="nesterov", merged_sha256="ab" * 32)
REFUSED = dict(ADOPTED, round=2, boundary=1, verdict="refused", gate=None,
               reason="gate: merged loss above gpu0's own")


def test_a_merge_round_reaches_tensorboard_as_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from launcher.pod.events import EventLog
    from launcher.pod.events_tensorboard import EventsToTensorBoard
    mirror = EventsToTensorBoard(tmp_path)
    log = EventLog(tmp_path, mirror=mirror)
    first = log.emit("merge_round", **ADOPTED)
    second = log.emit("merge_round", **REFUSED)
    mirror.close()
    acc = EventAccumulator(str(tmp_path / TENSORBOARD_RUN),
                           size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    assert "events/merge_round/text_summary" in acc.Tags()["tensors"]   # as every event

    def values(tag):
        return [(e.step, pytest.approx(e.value, abs=1e-6)) for e in acc.Scalars(tag)]
    assert values("merge/round") == [(int(first["ts"]), 1), (int(second["ts"]), 2)]
    assert values("merge/adopted") == [(int(first["ts"]), 1), (int(second["ts"]), 0)]
    assert values("merge/seconds")[0][1] == 41.0
    assert values("merge/gate_rise/gpu0") == [(int(first["ts"]), 0.012)]
    assert values("merge/gate_rise/gpu1") == [(int(first["ts"]), -0.003)]


def test_a_merge_round_marks_each_gpus_trackio_run(tmp_path):
    from launcher.config.tracker import TrackerSettings
    from launcher.supervise.tracker_sink import TrackerSink
    logged: dict[int, list] = {}

    class Run:
        def __init__(self, gpu):
            self.gpu = gpu

        def log(self, values, step):
            logged.setdefault(self.gpu, []).append((step, values))

        def finish(self):
            pass
    sink = TrackerSink(tmp_path, TrackerSettings("trackio", "p"), open_tracker=Run)
    sink.metrics(0, {"type": "metrics", "step": 7, "loss": 1.0})
    sink.metrics(1, {"type": "metrics", "step": 9, "loss": 1.0})
    sink({"event": "merge_round", "ts": T0, **ADOPTED})
    sink.close()
    assert (7, {"merge/round": 1.0, "merge/adopted": 1.0, "merge/seconds": 41.0,
                "merge/quorum": 2.0, "merge/gate_rise": 0.012}) in logged[0]
    assert (9, {"merge/round": 1.0, "merge/adopted": 1.0, "merge/seconds": 41.0,
                "merge/quorum": 2.0, "merge/gate_rise": -0.003}) in logged[1]
