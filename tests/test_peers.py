"""Each GPU against its peers (launcher/checks/peers.py): a slow GPU is a straggler, a GPU
whose loss leaves the pack a loss outlier, the others neither; through the supervisor an
alert event once per incident and a status mark, or a rollback when configured."""

from __future__ import annotations

import pytest
import yaml

import dataclasses

from launcher.checks.criteria import PeersSpec, parse_criteria
from launcher.checks.peers import LOSS, STRAGGLER, PeersCheck
from launcher.errors import UserError
from tests.support.fake_supervisor import events, make, pod_state, pod_template  # noqa: F401


SHIPPED = parse_criteria({}).peers       # manifests/trusted_loss.yaml's peers: section


def fed(speeds: dict[int, float], losses: dict[int, float], lines: int = 5,
        spec: PeersSpec = SHIPPED) -> PeersCheck:
    check = PeersCheck(spec)
    for i in range(lines):
        for gpu, tok_s in speeds.items():
            # a little noise per line: medians, not single readings, decide
            check.feed(gpu, {"tok_s": tok_s * (1 + 0.03 * ((i + gpu) % 3 - 1)),
                             "ema_tf": losses[gpu] + 0.001 * i})
    return check


def test_a_slow_gpu_is_a_straggler_and_its_peers_are_not():
    speeds = {0: 1000, 1: 1040, 2: 980, 3: 650, 4: 1010, 5: 995, 6: 1020, 7: 990}
    found = fed(speeds, {g: 5.0 for g in speeds}).judge()
    assert [(o.gpu, o.kind) for o in found] == [(3, STRAGGLER)]
    outlier = found[0]
    assert outlier.threshold == pytest.approx(0.7 * outlier.median)
    assert 990 < outlier.median < 1010 and outlier.value < 700
    # 20 % slower is inside the default fraction 0.7; a stricter fraction flags it
    speeds[3] = 800
    assert fed(speeds, {g: 5.0 for g in speeds}).judge() == []
    assert [o.gpu for o in fed(speeds, {g: 5.0 for g in speeds},
                               spec=dataclasses.replace(SHIPPED, fraction=0.9)).judge()] == [3]


def test_a_shifted_loss_is_flagged_and_a_spread_pack_is_not():
    speeds = {g: 1000 for g in range(6)}
    losses = {0: 5.02, 1: 4.98, 2: 5.0, 3: 5.01, 4: 5.6, 5: 4.99}
    found = fed(speeds, losses).judge()
    assert [(o.gpu, o.kind) for o in found] == [(4, LOSS)]
    assert found[0].median == pytest.approx(5.0, abs=0.03)
    # the same 0.6 gap inside a pack that spreads that much on its own is no outlier
    wide = {0: 5.3, 1: 4.7, 2: 5.0, 3: 5.4, 4: 5.6, 5: 4.6}
    assert fed(speeds, wide).judge() == []


def test_too_few_gpus_or_a_window_not_full_is_no_verdict():
    assert fed({0: 1000, 1: 1000, 2: 100}, {0: 5, 1: 5, 2: 9}).judge() == []
    assert fed({0: 1000, 1: 1000, 2: 100, 3: 1000}, {g: 5 for g in range(4)},
               lines=4).judge() == []


@pytest.mark.parametrize("peers, words", [
    ({"fraction": 1.5}, r"peers.fraction: must be in \(0, 1\], got 1.5"),
    ({"fraction": 0}, r"peers.fraction: must be in \(0, 1\], got 0"),
    ({"action": "reboot"}, "peers.action: must be one of alert, rollback"),
    ({"minGpus": 2}, "minGpus >= 3"),
    ({"k": -1}, "peers.k: must be a finite number >= 0"),
])
def test_bad_peers_settings_are_one_line(peers, words):
    with pytest.raises(UserError, match=words):
        parse_criteria({"peers": peers})


def test_the_shipped_criteria_file_holds_the_documented_settings():
    assert SHIPPED == PeersSpec(fraction=0.7, windowLines=5, k=5.0, minDeviation=0.05,
                                minGpus=4, action="alert")


def test_the_supervisor_alerts_once_per_incident_and_marks_the_gpu(make):
    sup, backend, clock = make(devices="cpu:4")
    sup.starter.start_all()
    for gpu in range(4):
        backend.train(gpu, 5, tok_s=300.0 if gpu == 2 else 1000.0,
                      tf=6.0 if gpu == 1 else 5.0)
    sup.step()
    flagged = events(sup, "gpu_outlier")
    assert sorted((e["gpu"], e["kind"]) for e in flagged) == [(1, LOSS), (2, STRAGGLER)]
    straggler = next(e for e in flagged if e["kind"] == STRAGGLER)
    assert straggler["action"] == "alert" and straggler["window"] == 5
    assert straggler["value"] == 300.0 and straggler["threshold"] == pytest.approx(700.0)
    marks = {g: s["peers"] for g, s in pod_state(sup)["gpus"].items()}
    assert set(marks["2"]) == {STRAGGLER} and "300 tok/s" in marks["2"][STRAGGLER]
    assert set(marks["1"]) == {LOSS} and marks["0"] == {} and marks["3"] == {}
    assert all(r.health.phase() != "Failed" for r in sup.pod.runs.values())   # alert only
    backend.train(2, 5, tok_s=300.0)
    sup.step()
    assert len(events(sup, "gpu_outlier", gpu=2)) == 1          # the same incident
    backend.train(2, 5, tok_s=1000.0)          # it caught up: mark cleared, said so
    sup.step()
    assert events(sup, "gpu_outlier_cleared", gpu=2, kind=STRAGGLER)
    assert pod_state(sup)["gpus"]["2"]["peers"] == {}


def test_with_action_rollback_the_straggler_fails_its_checks_and_the_stage_rolls_back(
        make, tmp_path, pod_template):
    import shutil
    pod = tmp_path / "pod"
    shutil.copytree(pod_template, pod)
    criteria = pod / "manifests" / "trusted_loss.yaml"
    doc = yaml.safe_load(criteria.read_text())
    doc["peers"]["action"] = "rollback"
    criteria.write_text(yaml.safe_dump(doc))
    sup, backend, clock = make(devices="cpu:4")
    sup.starter.start_all()
    for gpu in range(4):
        backend.train(gpu, 5, tok_s=300.0 if gpu == 2 else 1000.0)
    sup.step()                     # judged: GPU 2 fails its peers check
    (flagged,) = events(sup, "gpu_outlier")
    assert flagged["gpu"] == 2 and flagged["action"] == "rollback"
    sup.step()                     # the pod acts on the failed GPU as on any failed check
    (failed,) = events(sup, "check_failed")
    assert failed["gpu"] == 2 and "straggler" in failed["reason"]
