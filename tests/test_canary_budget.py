"""--max-time on a stage switch (issue 16, item 6): the canary spends the budget first, so the
launch says how the budget splits, and refuses one the canary alone would use up (a 90 s
budget once gave the canary 68 s and training 0 steps). The estimate comes from what the
pod recorded: its last canary, else its last worker run (launcher/supervise/canary_budget.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from launcher.cli import main as cli_main
from launcher.supervise.canary_budget import estimate_canary, split_budget
from launcher.supervise.plan import load_plan
from tests.support.pod_files import MANIFEST, tree

STAGE1 = {"gpu_0": {"start_token": 0, "stage": 1}, "gpu_1": {"start_token": 0, "stage": 1}}


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    pod = tmp_path_factory.mktemp("budget") / "pod"
    assert cli_main(["--pod-dir", str(pod), "init"]) == 0
    (pod / MANIFEST).write_text(json.dumps(STAGE1))
    return pod


@pytest.fixture
def pod(tmp_path, template) -> Path:
    shutil.copytree(template, tmp_path / "pod")
    return tmp_path / "pod"


def record(pod: Path, path: str, *records: dict) -> None:
    with open(pod / path, "a") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def last_canary(pod: Path, seconds: float, steps: int = 5) -> None:
    record(pod, "logs/events.jsonl", {"ts": 1.0, "event": "canary", "seconds": seconds,
                                      "per_step": [{}] * steps, "interrupted": None})


def test_a_budget_the_canary_alone_would_spend_is_refused_before_anything(pod, capsys):
    last_canary(pod, 68.0)
    before = tree(pod)
    code = cli_main(["--pod-dir", str(pod), "launch", "--stage", "2", "--max-time", "60"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "--max-time 60s would be spent by the canary alone (about 68s" in err[0]
    assert "the last canary on this pod" in err[0] and "above 68" in err[0]
    assert tree(pod) == before


def test_the_split_is_said_and_scaled_to_the_configured_steps(pod):
    last_canary(pod, 40.0, steps=2)      # the criteria file's canary.steps is 5
    plan, _ = load_plan(pod, 2, None, None, max_time=300)
    line = split_budget(plan, canary_runs=True)
    assert "about 100s for the canary (2 runs of 5 steps on GPU 0" in line
    assert "about 200s left to train" in line
    assert split_budget(plan, canary_runs=False) is None


def test_without_a_canary_the_last_worker_run_is_the_measure(pod):
    record(pod, "logs/events.jsonl", {"ts": 100.0, "event": "worker_start", "gpu": 0,
                                      "pid": 42})
    record(pod, "logs/metrics_gpu0.jsonl",
           {"type": "event", "event": "start", "ts": 112.0, "gpu": 0, "pid": 42},
           {"type": "metrics", "ts": 113.0, "step": 5, "gpu": 0},
           {"type": "metrics", "ts": 123.0, "step": 15, "gpu": 0})
    estimate = estimate_canary(pod, 0, steps=5)
    assert estimate.seconds == pytest.approx(2 * (12 + 5 * 1.0))
    assert "12s to start" in estimate.basis


def test_with_nothing_measured_the_split_names_the_canary_bound(pod):
    plan, _ = load_plan(pod, 2, None, None, max_time=90)
    line = split_budget(plan, canary_runs=True)
    assert "at most 1800s by canary.timeout_s" in line and "runs first" in line
