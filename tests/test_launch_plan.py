"""The launch plan (launcher/supervise/plan.py) is built once from every file a person writes:
after it, nothing the launch runs reads those files again (issue 17: the canary re-read the
config, stages, criteria and manifest from disk).

The canary here runs a stand-in worker (python -c: it writes the same metrics lines for any
stage), so the gate runs for real in a second, with no model.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
from pathlib import Path

import pytest
import yaml

from launcher.checks.canary import read_canary_state
from launcher.pod.setup_init import init_pod, write_config
from launcher.config.podconfig import SyncSettings, load_pod_config
from launcher.errors import UserError
from launcher.pod.events import EventLog, read_events
from launcher.supervise.plan import load_plan
from launcher.supervise.stage_switch import EarlyStop, canary_gate
from launcher.supervise.custodian import CheckpointCustodian
from launcher.supervise.supervisor import Supervisor
from tests.support.fake_backend import FakeBackend
from tests.support.fake_supervisor import Clock

# Writes MAX_STEPS identical metrics lines: both canary runs agree exactly, at any stage.
STAND_IN_WORKER = """
import json, os
with open(os.environ["METRICS"], "a") as out:
    out.write(json.dumps({"event": "start", "next_token": 0}) + "\\n")
    for step in range(1, int(os.environ["MAX_STEPS"]) + 1):
        out.write(json.dumps({"type": "metrics", "step": step, "next_token": 8 * step,
                              "tf": 5.0, "lb": 2.0, "grad_norm": 1.0, "ema_tf": 5.0}) + "\\n")
"""


@pytest.fixture
def pod(tmp_path) -> Path:
    """A tiny-cpu pod at stage 1 on GPU 0 (a fresh start) whose canary takes 3 steps."""
    pod = tmp_path / "pod"
    init_pod(pod, "tiny-cpu")
    config = load_pod_config(pod)
    config.worker = ["python", "-c", STAND_IN_WORKER]
    config.sync = {"interval": "30m"}
    write_config(pod, config, "test")
    criteria = pod / config.criteria
    doc = yaml.safe_load(criteria.read_text())
    doc["canary"] = {**doc.get("canary", {}), "steps": 3}
    criteria.write_text(yaml.safe_dump(doc))
    (pod / config.manifest).parent.mkdir(parents=True, exist_ok=True)
    (pod / config.manifest).write_text(json.dumps({"gpu_0": {"stage": 1, "start_token": 0}}))
    return pod


def overwrite_what_a_person_writes(pod: Path, plan) -> None:
    """Every file the plan was built from, made unreadable as YAML/JSON: a reread now fails."""
    for name in ("fractus-pod.yaml", plan.config.stages, plan.config.criteria,
                 plan.config.manifest):
        (pod / name).write_text("{ not: [yaml")


def test_the_canary_gate_reads_the_plan_not_the_files(pod):
    plan, manifest = load_plan(pod, 2, "cpu:1", None)
    assert plan.trusted.canary.steps == 3
    overwrite_what_a_person_writes(pod, plan)
    events = EventLog(pod)

    canary_gate(plan, manifest, events, no_canary=False, stop=EarlyStop(None))

    (canary,) = [e for e in read_events(pod) if e["event"] == "canary"]
    assert canary["passed"], canary["reason"]
    assert (canary["from_stage"], canary["to_stage"]) == (1, 2)
    assert len(canary["per_step"]) == 3             # the plan's canary.steps, not a reread
    assert read_canary_state(pod)["status"] == "Successful"


def test_supervision_reads_the_plan_not_the_files(pod):
    """The supervisor, its health checks, restart policy, probe monitor and hub sync, over
    the fake backend: it trains to a checkpoint and through a crash and its restart with
    every file gone bad under it."""
    plan, manifest = load_plan(pod, 1, "cpu:1", None)
    overwrite_what_a_person_writes(pod, plan)
    backend, clock = FakeBackend(pod), Clock()
    log = EventLog(pod)
    sup = Supervisor(plan, manifest, CheckpointCustodian.for_plan(plan, manifest, log), log,
                     backend=backend, clock=clock)
    sup.starter.start_all()
    backend.train(0, 50)
    backend.checkpoint(0)
    backend.exit(0, 1)
    sup.step()
    clock.now += 120
    sup.step()
    started = [e for e in read_events(pod) if e["event"] == "worker_start"]
    assert len(started) == 2                        # the restart, by the plan's policy
    assert manifest.entries[0].start_token > 0      # the checkpoint, recorded


def test_the_plan_carries_the_typed_sections_and_is_frozen(pod):
    plan, _ = load_plan(pod, 1, "cpu:1", None, ray_address="127.0.0.1:6379")
    assert plan.sync == SyncSettings(interval_s=1800.0)
    assert plan.ray.address == "127.0.0.1:6379"
    assert plan.criteria is plan.trusted.criteria
    assert plan.trusted.canary.steps == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.stage = 2


def test_faults_are_the_starters_and_the_plan_never_changes(pod):
    """A fault goes to its GPU's first start only, kept by the starter: two supervisors of
    one plan each inject it once, and the plan is as it was (it once popped them itself)."""
    plan, manifest = load_plan(pod, 1, "cpu:1", None)
    before = copy.deepcopy(plan)
    for _ in range(2):
        backend, clock = FakeBackend(pod), Clock()
        log = EventLog(pod)
        sup = Supervisor(plan, manifest, CheckpointCustodian.for_plan(plan, manifest, log), log,
                         backend=backend, clock=clock, faults={0: "nan@30"})
        sup.starter.start_all()
        backend.exit(0, 1)
        sup.step()
        clock.now += 120
        sup.step()
        assert [w.spec.fault for w in backend.started] == ["nan@30", None]
    assert plan == before


def test_the_supervisor_makes_its_ray_backend_when_opened_not_when_built(pod, monkeypatch):
    """Built before a --detach fork, the supervisor of a Ray plan reaches for Ray only in
    open_backend, after it: here Ray is missing, which is then one line (exit 2)."""
    monkeypatch.setitem(sys.modules, "ray", None)      # as if the `ray` extra were missing
    plan, manifest = load_plan(pod, 1, "cpu:1", None, ray_address="127.0.0.1:6379")
    log = EventLog(pod)
    sup = Supervisor(plan, manifest, CheckpointCustodian.for_plan(plan, manifest, log), log)
    assert sup.pod.backend.name == "local" and not sup.pod.custodian.on_nodes
    with pytest.raises(UserError, match=r"^--ray needs Ray: .*pip install"):
        sup.open_backend()
