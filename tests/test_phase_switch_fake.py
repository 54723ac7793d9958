"""The supervisor's phase switch (launcher/supervise/phase_switch.py) over the fake backend:
which worker ends are switched, what the manifest and the next worker get, and a launch after
the switch was committed (a launcher killed right after its manifest write)."""

from __future__ import annotations

import json

import pytest
import yaml

from launcher.pod.manifest import read_manifest
from launcher.supervise.state import GpuState, PodState
from tests.support.fake_backend import TOKENS_PER_STEP
from tests.support.fake_supervisor import (  # noqa: F401 (fixtures)
    ProbeRecorder,
    events,
    make,
    pod_template,
)

PHASE2 = "data/shard_phase2_gpu{i}.npy"
SHARDS = ["data/shard_gpu{i}.pt", {"shard": PHASE2, "name": "phase2"}]


@pytest.fixture
def phased(make, tmp_path, pod_template):
    """`make` for a pod whose shards: lists two phases."""
    def build(**kwargs):
        import shutil
        pod = tmp_path / "pod"
        if not pod.exists():
            shutil.copytree(pod_template, pod)
            config = yaml.safe_load((pod / "fractus-pod.yaml").read_text())
            config["shards"] = SHARDS
            (pod / "fractus-pod.yaml").write_text(yaml.safe_dump(config))
        return make(**kwargs)
    return build


def test_the_end_of_phase_one_switches_the_gpu_and_the_end_of_the_last_is_done(phased):
    sup, backend, clock = phased(stage=1)
    told = []
    sup.pod.custodian.manifest_changed = told.append   # the hub sync's hook
    sup.starter.start_all()
    probes = sup.pod.probes = ProbeRecorder()
    backend.train(0, 10)
    ended = backend.checkpoint(0)
    backend.end_of_shard(0)
    sup.step()
    entry = read_manifest(sup.pod.manifest.path).entries[0]
    assert (entry.position, entry.shard, entry.checkpoint_sha256) == \
        ((2, 0), PHASE2.format(i=0), ended["sha256"])
    switch, = events(sup, "phase_switch")
    assert told == ["phase switch"]
    # The AR probes get phase 2's baseline from the end of phase 1 probed on phase 2's shard.
    assert probes.phase_starts == [(0, "checkpoints/fractus_1b_gpu0.pt", PHASE2.format(i=0))]
    assert (switch["gpu"], switch["from_phase"], switch["to_phase"], switch["ended_at_token"],
            switch["start_token"]) == (0, 1, 2, 10 * TOKENS_PER_STEP, 0)
    spec = backend.current(0).spec
    assert (spec.phase, spec.start_token, spec.ckpt_in) == \
        (2, 0, "checkpoints/fractus_1b_gpu0.pt")
    assert sup.pod.runs[0].state is GpuState.RUNNING
    assert events(sup, "worker_start", gpu=0)[-1]["phase"] == 2
    # Phase 2, the last: its end is the GPU's end.
    backend.train(0, 4)
    backend.checkpoint(0)
    backend.end_of_shard(0)
    sup.step()
    assert sup.pod.runs[0].state is GpuState.DONE
    assert len(events(sup, "phase_switch")) == 1 and told == ["phase switch"]
    assert read_manifest(sup.pod.manifest.path).entries[0].position == (2, 4 * TOKENS_PER_STEP)
    backend.exit(1, 0)
    sup.step()
    assert sup.pod.state is PodState.DONE


def test_only_the_end_of_a_shard_whose_checkpoint_the_manifest_holds_is_switched(phased):
    sup, backend, clock = phased(stage=1)
    sup.starter.start_all()
    backend.train(0, 5)
    backend.checkpoint(0)
    backend.event(0, "done", reason="max_steps", step=5, next_token=5 * TOKENS_PER_STEP,
                  phase=1)
    backend.exit(0, 0)                     # --max-steps: done, no switch
    backend.train(1, 5)
    backend.checkpoint(1)
    backend.train(1, 2)                    # past its last checkpoint: not what the manifest holds
    backend.end_of_shard(1)
    sup.step()
    assert not events(sup, "phase_switch")
    assert [sup.pod.runs[g].state for g in (0, 1)] == [GpuState.DONE, GpuState.DONE]
    assert all(e.at_phase == 1 for e in read_manifest(sup.pod.manifest.path).entries.values())


def test_a_launch_after_the_committed_switch_starts_phase_two_at_token_zero(phased):
    sup, backend, clock = phased(stage=1)
    manifest = sup.pod.manifest.path
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({"gpu_0": {
        "start_token": 0, "phase": 2, "shard": PHASE2.format(i=0),
        "checkpoint": "checkpoints/fractus_1b_gpu0.pt", "stage": 1}}))
    sup, backend, clock = phased(stage=1)          # the next launch reads it
    sup.starter.start_all()
    spec = backend.current(0).spec
    assert (spec.phase, spec.start_token, spec.ckpt_in) == \
        (2, 0, "checkpoints/fractus_1b_gpu0.pt")
    assert backend.current(1).spec.phase == 1
    assert not events(sup, "phase_switch")


CURVE_CHECKS = ("trend", "lb_band", "loss_spike")


def _jump(sup, backend, switch: bool):
    """GPU 0 trains 60 steps at tf 5 (the loss-spike window full), ends them at a checkpoint,
    then (switched to phase 2 or not) 250 steps at tf 11 and lb 6: a jump every curve check
    sees (trend, lb_band's band 3, 2 x the rolling mean)."""
    sup.starter.start_all()
    backend.train(0, 60)
    backend.checkpoint(0)
    if switch:
        backend.end_of_shard(0)
    sup.step()
    backend.train(0, 250, tf=11.0, lb=6.0)
    sup.step()
    return sup.pod.runs[0].health


def test_a_loss_jump_at_a_phase_switch_is_new_data_not_a_regression(phased):
    sup, backend, clock = phased(stage=1)
    health = _jump(sup, backend, switch=True)
    assert events(sup, "phase_switch")
    checks = health.verdict().checks
    assert not health.failed(), health.verdict().reason
    assert all(checks[name]["failures"] == 0 for name in CURVE_CHECKS + ("continuity",))
    assert sup.pod.runs[0].state is GpuState.RUNNING and not events(sup, "rollback")
    # The checks started over on phase 2's curve: a jump within the phase still fails.
    backend.train(0, 5, tf=25.0)
    sup.step()
    assert health.verdict().checks["loss_spike"]["phase"] == "Failed"


def test_the_same_loss_jump_without_a_phase_switch_fails_the_curve_checks(phased):
    sup, backend, clock = phased(stage=1)
    health = _jump(sup, backend, switch=False)
    assert not events(sup, "phase_switch")
    checks = health.verdict().checks
    assert health.failed()
    assert all(checks[name]["phase"] == "Failed" for name in CURVE_CHECKS), checks


def test_a_launch_at_phase_twos_token_zero_has_no_phase_one_curve_to_continue(phased):
    sup, backend, clock = phased(stage=1)
    manifest = sup.pod.manifest.path
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({"gpu_0": {
        "start_token": 0, "phase": 2, "shard": PHASE2.format(i=0), "ema_tf": 5.0, "lb": 2.0,
        "checkpoint": "checkpoints/fractus_1b_gpu0.pt", "stage": 1}}))
    sup, backend, clock = phased(stage=1)          # the next launch reads it
    sup.starter.start_all()
    backend.train(0, 250, tf=11.0, lb=6.0)         # phase 2's data, from the first line
    sup.step()
    health = sup.pod.runs[0].health
    assert not health.failed(), health.verdict().reason
