"""The GPUs' metrics mirrored to trackio (`tracker:`, issue 19): a supervised pod over the
fake backend (tests/support/fake_supervisor.py) puts each GPU's metrics lines, with their
steps and values, and its rollback into trackio's local store inside the pod; a tracker
that fails turns itself off with one warning while supervision goes on; a bad `tracker:`
is refused with one line and the pod left as it was; a tracker that hangs never holds the
supervisor (its lines past the bounded queue are dropped and counted)."""

import json
import shutil
import sqlite3
import sys
import threading

import pytest
import yaml

from launcher.cli import main as cli_main
from launcher.config.tracker import TrackerSettings
from launcher.errors import install_hint
from launcher.paths import TRACKIO_DIR
from launcher.supervise.state import GpuState, PodState
from launcher.supervise.tracker_sink import QUEUE_LINES, TrackerSink
from tests.support.fake_supervisor import (  # noqa: F401 (fixtures)
    events,
    make,
    passed_checkpoint,
    pod_template,
)

PROJECT = "fractus-test"


@pytest.fixture
def tracked(tmp_path, pod_template, monkeypatch):
    """The pod's config with `tracker:`; trackio's environment restored afterwards (the
    sink points TRACKIO_DIR at the pod)."""
    pod = tmp_path / "pod"
    shutil.copytree(pod_template, pod)
    tracker_config(pod, {"kind": "trackio", "project": PROJECT})
    monkeypatch.setenv("TRACKIO_DIR", str(pod / TRACKIO_DIR))
    return pod


def stored_rows(pod) -> dict[str, list[tuple[int, dict]]]:
    """trackio's SQLite store, read as trackio writes it: run name -> (step, values)."""
    with sqlite3.connect(pod / TRACKIO_DIR / f"{PROJECT}.db") as db:
        rows = db.execute("SELECT run_name, step, metrics FROM metrics ORDER BY id").fetchall()
    runs: dict[str, list] = {}
    for name, step, values in rows:
        runs.setdefault(name, []).append((step, json.loads(values)))
    return runs


def test_each_gpus_metrics_its_rollback_and_stage_change_reach_trackios_store_in_the_pod(tracked, make):
    pytest.importorskip("trackio")
    sup, backend, clock = make()
    sup.starter.start_all()
    backend.train(1, 3, tf=6.5, tok_s=900.0)
    good = passed_checkpoint(sup, backend, 0)         # GPU 0 trains 101 steps at tf 5.0
    backend.train(0, 10)
    backend.event(0, "nan", step=112)
    sup.step()
    sup.step()
    assert events(sup, "rollback", gpu=0)
    sup.pod.tracker.close()
    runs = stored_rows(tracked)
    assert sorted(runs) == ["gpu0", "gpu1"]
    assert [(step, v["tf"], v["tok_s"]) for step, v in runs["gpu1"] if "tf" in v] == \
        [(1, 6.5, 900.0), (2, 6.5, 900.0), (3, 6.5, 900.0)]
    trained = [(step, v) for step, v in runs["gpu0"] if "tf" in v]
    assert [step for step, _ in trained] == list(range(1, 112))
    assert {(v["tf"], v["ema_tf"], v["lb"]) for _, v in trained} == {(5.0, 5.0, 2.0)}
    assert trained[0][1]["next_token"] < good["next_token"] < trained[-1][1]["next_token"]
    # The rollback marks GPU 0's run at its last step, the stage change (3 -> 2) every run.
    assert (111, {"rollback": 1}) in runs["gpu0"]
    assert all("rollback" not in v for _, v in runs["gpu1"])
    assert (111, {"stage": 2}) in runs["gpu0"] and (3, {"stage": 2}) in runs["gpu1"]


def test_a_tracker_that_fails_turns_off_with_one_warning_and_supervision_goes_on(
        tracked, make, capfd):
    (tracked / TRACKIO_DIR).parent.mkdir(exist_ok=True)
    (tracked / TRACKIO_DIR).write_text("not a directory")     # the store cannot be opened
    sup, backend, clock = make()
    sup.starter.start_all()
    backend.train(0, 5)
    sup.step()
    sink = sup.pod.tracker
    sink._thread.join(30)               # the sink's thread met the failure and ended
    assert sink.off
    good = passed_checkpoint(sup, backend, 0)          # the checks still read every line
    backend.train(1, 120)
    sup.step()
    assert sup.pod.state == PodState.RUNNING
    assert sup.pod.runs[1].last_metrics["step"] == 120
    assert sup.pod.custodian.index.records[(0, good["sha256"])]["verdict"] == "passed"
    assert all(run.state == GpuState.RUNNING for run in sup.pod.runs.values())
    sup.pod.tracker.close()
    warnings = [line for line in capfd.readouterr().err.splitlines() if "tracker" in line]
    assert len(warnings) == 1 and "tracker trackio turned off" in warnings[0], warnings


def tracker_config(pod, tracker) -> None:
    config = pod / "fractus-pod.yaml"
    doc = yaml.safe_load(config.read_text())
    doc["tracker"] = tracker
    config.write_text(yaml.safe_dump(doc))


def pod_files(pod) -> list:
    return sorted((p, p.read_bytes() if p.is_file() else None) for p in pod.rglob("*"))


@pytest.mark.parametrize("tracker, words", [
    ({"kind": "wandb2", "project": "p"}, "tracker.kind must be one of trackio"),
    ({"kind": "trackio"}, "tracker.project must be a name"),
    ({"kind": "trackio", "project": "../elsewhere"}, "tracker.project must be a name"),
    ({"kind": "trackio", "project": "p", "dir": "/tmp"}, "unknown key(s) ['dir']"),
    ("trackio", "tracker must be a mapping"),
])
def test_a_bad_tracker_is_one_line_and_writes_nothing(tmp_path, pod_template, capsys,
                                                      tracker, words):
    pod = tmp_path / "pod"
    shutil.copytree(pod_template, pod)
    tracker_config(pod, tracker)
    before = pod_files(pod)
    assert cli_main(["--pod-dir", str(pod), "launch", "--max-time", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0] and err[0].startswith("error: "), err
    assert pod_files(pod) == before


def test_a_tracker_without_trackio_installed_is_refused_before_anything_is_written(
        tmp_path, pod_template, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "trackio", None)     # as if it were not installed
    pod = tmp_path / "pod"
    shutil.copytree(pod_template, pod)
    tracker_config(pod, {"kind": "trackio", "project": PROJECT})
    before = pod_files(pod)
    assert cli_main(["--pod-dir", str(pod), "launch", "--max-time", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{install_hint('tracker')}, or remove" in err[0], err
    assert pod_files(pod) == before


class HungTracker:
    """A tracker whose every call waits until released (a store on a disk that stalls)."""

    def __init__(self):
        self.release, self.logged = threading.Event(), []

    def __call__(self, gpu):
        return self

    def log(self, values, step):
        self.release.wait()
        self.logged.append(step)

    def finish(self):
        pass


def test_a_hung_tracker_never_holds_the_caller_it_drops_past_its_queue(tmp_path):
    hung = HungTracker()
    sink = TrackerSink(tmp_path, TrackerSettings("trackio", PROJECT), open_tracker=hung)
    lines = QUEUE_LINES + 500
    for step in range(1, lines + 1):    # returns at once although nothing is written
        sink.metrics(0, {"type": "metrics", "step": step, "tf": 5.0})
    # The queue holds QUEUE_LINES; the thread took at most one more off it (it waits in log).
    assert 499 <= sink.dropped <= 500
    hung.release.set()
    sink.close()
    assert hung.logged == list(range(1, lines - sink.dropped + 1))
