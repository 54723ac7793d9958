"""A real Supervisor over the fake backend (tests/support/fake_backend.py) and a fake clock:
the fixtures and helpers the supervision-logic tests share (no processes)."""

import shutil
import time

import pytest
import yaml

from launcher.pod.setup_init import init_pod
from launcher.pod.ckpt_index import PASSED
from launcher.pod.events import EventLog, read_events
from launcher.pod.live_state import read_pod_state
from launcher.supervise.plan import load_plan
from launcher.supervise.custodian import CheckpointCustodian
from launcher.supervise.prepare import complete_decided_rollback
from launcher.supervise.supervisor import Supervisor
from tests.support.fake_backend import FakeBackend
from tests.support.fake_custodian import FakeCopies

__all__ = ["Clock", "LauncherKilled", "ProbeRecorder", "events", "killed_mid_rollback", "make",
           "on_nodes", "passed_checkpoint", "pod_state", "pod_template", "prepare_relaunch",
           "step_until"]


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def pod_template(tmp_path_factory):
    pod = tmp_path_factory.mktemp("template") / "pod"
    init_pod(pod, "tiny-cpu")
    criteria = pod / "manifests" / "trusted_loss.yaml"
    doc = yaml.safe_load(criteria.read_text())
    doc["probe"]["every"] = 0            # no probe processes: this module starts none
    criteria.write_text(yaml.safe_dump(doc))
    return pod


@pytest.fixture
def make(tmp_path, pod_template):
    def build(stage=3, nodes=None, max_time=None, mirror=None, devices="cpu:2",
              on_nodes=False):
        """`on_nodes`: the checkpoints are on the nodes (as on Ray), not on this machine;
        where they are is `sup.pod.custodian.copies` (tests/support/fake_custodian.py)."""
        pod = tmp_path / "pod"
        if not pod.exists():
            shutil.copytree(pod_template, pod)
        plan, manifest = load_plan(pod, stage, devices, None, max_time=max_time)
        backend, clock, events = FakeBackend(pod, nodes), Clock(), EventLog(pod, mirror=mirror)
        copies = FakeCopies(pod, plan.config, events, backend, on_nodes=on_nodes)
        sup = Supervisor(plan, manifest, CheckpointCustodian.for_plan(plan, manifest, events),
                         events, backend=backend, clock=clock, copies=copies)
        return sup, backend, clock
    return build


def on_nodes(sup, backend) -> FakeCopies:
    """Switch `sup` to checkpoints kept on the nodes, as the launcher does for a Ray pod
    (Supervisor.use_backend): the nodes push them, the hub sync pushes the manifest."""
    copies = FakeCopies(sup.pod.pod_dir, sup.pod.plan.config, sup.pod.events, backend,
                        on_nodes=True)
    sup.use_backend(backend, copies)
    return copies


def events(sup, name, **match):
    return [e for e in read_events(sup.pod.pod_dir) if e["event"] == name
            and all(e.get(k) == v for k, v in match.items())]


def step_until(sup, condition, what: str, timeout: float = 60):
    """Step `sup` until `condition()` holds and return its value: for what a thread of the
    launcher does (a hub push), which the fake clock does not drive."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        sup.step()
        time.sleep(0.05)


def crash_past_the_restart_budget(sup, backend, clock, gpu: int = 0) -> None:
    """GPU `gpu`'s worker crashes once more than max_restarts (3) allows, each restart
    waited for."""
    for _ in range(4):
        backend.exit(gpu, 1)
        sup.step()
        clock.now += 120
        sup.step()


class LauncherKilled(BaseException):
    """Stands for a SIGKILL of the launcher: nothing after it runs."""


def killed_mid_rollback(sup, backend, monkeypatch) -> None:
    """`sup`'s next step rolls back, and the launcher is SIGKILLed while the workers stop
    (the others have saved)."""
    stop = backend.stop

    def killed(handles, grace_s):
        stop(handles, grace_s)
        raise LauncherKilled()
    monkeypatch.setattr(backend, "stop", killed)
    with pytest.raises(LauncherKilled):
        sup.step()


def prepare_relaunch(pod_dir, devices: str = "cpu:2"):
    """The next plain launch (no --stage) through launch's own preparation steps: its plan."""
    plan, manifest = load_plan(pod_dir, None, devices, None)
    custodian = CheckpointCustodian.for_plan(plan, manifest, EventLog(pod_dir))
    plan = complete_decided_rollback(plan, manifest, custodian, stage_given=False)
    custodian.reconcile(plan.stage)
    custodian.never_resume_failed()
    return plan


def pod_state(sup) -> dict:
    """logs/pod_state.json as `status` reads it (written now: the loop throttles writes)."""
    sup.view.write(force=True)
    return read_pod_state(sup.pod.pod_dir)


def passed_checkpoint(sup, backend, gpu) -> dict:
    """Train GPU `gpu` to a checkpoint at step 50 and on to step 101, where the periodic
    checks (every 100 steps from the first line) vouch for it."""
    backend.train(gpu, 50)
    event = backend.checkpoint(gpu)
    backend.train(gpu, 51)
    sup.step()
    record = sup.pod.custodian.index.records[(gpu, event["sha256"])]
    assert record["verdict"] == PASSED
    return event


class ProbeRecorder:
    """Stands in for the ProbeMonitor: records what would be probed, judges nothing."""

    def __init__(self):
        self.requests = []
        self.phase_starts = []      # (gpu, checkpoint, shard) of each phase switch

    def start_phase(self, gpu, checkpoint, shard):
        self.phase_starts.append((gpu, checkpoint, shard))

    def on_checkpoint(self, gpu, checkpoint, shard, sha256, step):
        self.requests.append((gpu, checkpoint, sha256))

    def vouched_step(self, gpu):
        return None

    def poll(self):
        return []

    def busy(self):
        return False
