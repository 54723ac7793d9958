"""On a Ray pod, a GPU that fails before any checkpoint of it passed starts over at token 0
on its node as on one machine, with the launcher alive and after a launcher killed in the
middle of the rollback: its node renames its own checkpoint files `NAME.failed` before the
worker starts, so the worker does not resume from that failed work (it refused it: exit 2,
START_TOKEN disagrees with the checkpoint).

The head is the real Supervisor over the fake backend (tests/support/fake_supervisor.py);
the start it decides goes through the real RayBackend.start to the real NodeWorker (Ray's
context stubbed: no cluster), which starts a real child process resolving its checkpoint as
the worker does (fractus/train/resume.py)."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest
import torch

from launcher.paths import worker_log_path
from launcher.pod.events import EventLog, read_events
from launcher.supervise.ray.driver import RayBackend
from launcher.supervise.ray.starts import GpuStarts
from tests.support.fake_supervisor import (  # noqa: F401 (fixtures)
    killed_mid_rollback,
    make,
    passed_checkpoint,
    pod_template,
    prepare_relaunch,
)

OWN = "checkpoints/fractus_1b_gpu0.pt"
# The worker's choice of checkpoint (CKPT_IN, else its own file CKPT_OUT), and its refusal
# of a START_TOKEN that disagrees with that checkpoint, as fractus/train/resume.py does.
WORKER = """
import json, os, sys, torch
from types import SimpleNamespace
from fractus.train.resume import _source
source = _source(SimpleNamespace(ckpt_in=os.environ.get("CKPT_IN"), allow_fresh_start=True,
                                 ckpt_out_path=os.environ["CKPT_OUT"]))
start = int(os.environ["START_TOKEN"])
if source is not None:
    token = torch.load(source, weights_only=True)["train_state"]["next_token"]
    if token != start:
        print(f"START_TOKEN={start} disagrees with the checkpoint {source} "
              f"(next_token={token})")
        sys.exit(2)
json.dump({"source": source and str(source), "start": start}, open("resumed.json", "w"))
"""


@pytest.fixture
def node(tmp_path, monkeypatch):
    """GPU 0's node: a real NodeWorker whose disk holds the GPU's own save (token 320,
    rotated once), the checkpoint the head is about to judge failed."""
    import ray

    from launcher.supervise.ray.node import NodeWorker
    monkeypatch.setattr(ray, "get_runtime_context", lambda: SimpleNamespace(
        get_node_id=lambda: "a1b2c3d4e5f6" * 4))
    worker = NodeWorker(0, str(tmp_path / "node"), str(tmp_path / "pod"), None, None,
                        [sys.executable, "-c", WORKER], fence_s=3600.0, grace_s=5.0)
    own = worker.workdir / OWN
    own.parent.mkdir(parents=True)
    for name, token in ((f"{OWN}.1", 160), (OWN, 320)):
        torch.save({"model_state": {"w": torch.zeros(4)}, "config": {},
                    "train_state": {"next_token": token}}, worker.workdir / name)
    return worker


def start_on_node(node, sup, spec) -> dict:
    """The head's start `spec` of GPU 0, through the real RayBackend, on `node`: what the
    worker resumed from, and the events the backend wrote when the start answered."""
    import ray
    backend = object.__new__(RayBackend)
    pod = sup.pod.pod_dir
    backend.pod_dir, backend.handles, backend.slots = pod, {}, {}
    backend.config, backend.events = sup.pod.plan.config, EventLog(pod)
    backend.starts = GpuStarts(pod, backend.config)
    backend.heartbeat = SimpleNamespace(heard=lambda actor: None)
    answers = {}

    def remote(*args):                  # the actor's start, answered at once
        answers["start-0"] = node.start(*args)
        return "start-0"
    backend.ray = SimpleNamespace(wait=lambda refs, num_returns=1, timeout=None: (refs, []),
                                  get=answers.get, exceptions=ray.exceptions)
    backend.actors = {0: SimpleNamespace(start=SimpleNamespace(remote=remote))}
    handle = backend.start(spec)
    backend._placed([handle])
    assert node.host.proc.wait(timeout=120) == 0, \
        (node.workdir / worker_log_path(0)).read_text()      # exit 2: it refused its file
    return json.loads((node.workdir / "resumed.json").read_text())


def fail_gpu0_before_anything_of_it_passed(sup, backend) -> None:
    """GPU 1 has a passed checkpoint; GPU 0 wrote one not judged yet, then its loss goes
    NaN: the one rule sends GPU 0 back to token 0 at stage 2."""
    sup.starter.start_all()
    passed_checkpoint(sup, backend, 1)
    backend.train(0, 10)
    backend.checkpoint(0)
    sup.step()
    backend.event(0, "nan", step=11)


def assert_started_over_on_its_node(node, sup, spec) -> None:
    assert (spec.start_token, spec.ckpt_in, spec.start_over) == (0, None, True)
    resumed = start_on_node(node, sup, spec)
    assert resumed == {"source": None, "start": 0}      # a new model at token 0: no refusal
    workdir = node.workdir
    assert not (workdir / OWN).exists() and not (workdir / f"{OWN}.1").exists()
    kept = torch.load(workdir / f"{OWN}.failed", weights_only=True)   # renamed, not deleted
    assert kept["train_state"]["next_token"] == 320
    assert (workdir / f"{OWN}.1.failed").is_file()
    (said,) = [e for e in read_events(sup.pod.pod_dir) if e["event"] == "checkpoint_set_aside"]
    assert said["gpu"] == 0 and said["set_aside"] == [OWN, f"{OWN}.1"]


def test_a_gpu_starting_over_on_its_node_sets_its_own_files_aside(make, node):
    """Seen: the head renamed its own copy of the GPU's file (none on a Ray head), the node's
    stayed, and the worker resumed from it and refused START_TOKEN=0 (exit 2)."""
    sup, backend, clock = make(stage=3)
    fail_gpu0_before_anything_of_it_passed(sup, backend)
    sup.step()
    assert sup.pod.stage == 2
    restarted = [w for w in backend.started if w.gpu == 0][-1]
    assert_started_over_on_its_node(node, sup, restarted.spec)


def test_after_a_launcher_killed_mid_rollback_the_relaunch_starts_it_over_on_its_node(
        make, node, monkeypatch):
    sup, backend, clock = make(stage=3)
    fail_gpu0_before_anything_of_it_passed(sup, backend)
    killed_mid_rollback(sup, backend, monkeypatch)
    # The next plain launch: launch's own preparation steps, then its supervisor's start.
    assert prepare_relaunch(sup.pod.pod_dir).stage == 2
    sup, backend, clock = make(stage=2)
    assert_started_over_on_its_node(node, sup, sup.starter.spec(sup.pod.runs[0]))
