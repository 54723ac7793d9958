"""`merge_rounds:` in fractus-pod.yaml and `merge_gate:` in trusted_loss.yaml (issue 28): off
by default; every mistake refused by `launch` with exit 2 and one line naming the value and
the fix, nothing written; a Ray pod or a quorum above the launch's GPUs refused; the gate's
verdict from its measurements (the band, a non-finite loss, a Failed AR probe)."""

from __future__ import annotations

import math

import pytest
import yaml

from launcher.checks.merge_gate import MergeGate, judge
from launcher.checks.probe_check import ProbeTolerance
from launcher.checks.trusted_loss import load_criteria_file
from launcher.cli import main as cli_main
from launcher.config.merge_rounds_settings import MergeRoundSettings, OuterSettings
from launcher.config.podconfig import load_pod_config
from launcher.errors import UserError
from launcher.supervise.plan import load_plan
from tests.support.e2e import make_pod


def set_rounds(pod, rounds) -> None:
    config = yaml.safe_load((pod / "fractus-pod.yaml").read_text())
    config["merge_rounds"] = rounds
    (pod / "fractus-pod.yaml").write_text(yaml.safe_dump(config))


def test_off_by_default_and_the_defaults_when_on(tmp_path):
    pod = make_pod(tmp_path)
    assert load_pod_config(pod).merge_round_settings() is None
    set_rounds(pod, {"every_tokens": 1000, "outer": "nesterov"})
    s = load_pod_config(pod).merge_round_settings()
    assert s == MergeRoundSettings(1000, False, OuterSettings("nesterov", 0.7, 0.9), "equal",
                                   None, 600.0)
    assert s.quorum_of(8) == 8


@pytest.mark.parametrize("rounds, named", [
    ({"outer": "mean"}, "no trigger"),
    ({"every_tokens": 0}, "every_tokens"),
    ({"every_tokens": -5}, "every_tokens"),
    ({"every_tokens": 1.5}, "every_tokens"),
    ({"every_tokens": 100, "outer": "adam"}, "outer"),
    ({"every_tokens": 100, "lr": 0.5}, "merge_rounds.lr applies to outer: nesterov"),
    ({"every_tokens": 100, "outer": "nesterov", "lr": 3}, "merge_rounds.lr"),
    ({"every_tokens": 100, "outer": "nesterov", "momentum": 1.0}, "merge_rounds.momentum"),
    ({"every_tokens": 100, "outer": "nesterov", "lr": float("nan")}, "merge_rounds.lr"),
    ({"every_tokens": 100, "weights": "loss"}, "weights"),
    ({"every_tokens": 100, "quorum": 0}, "quorum"),
    ({"every_tokens": 100, "grace_s": -1}, "grace_s"),
    ({"every_tokens": 100, "at_stage_end": "yes"}, "at_stage_end"),
    ({"every_tokens": 100, "evry": 3}, "evry"),
    ("often", "merge_rounds"),
])
def test_a_mistake_is_refused_by_launch_in_one_line_nothing_written(tmp_path, capsys, rounds,
                                                                     named):
    pod = make_pod(tmp_path)
    set_rounds(pod, rounds)
    before = sorted(p.relative_to(pod) for p in pod.rglob("*"))
    assert cli_main(["--pod-dir", str(pod), "launch", "--stage", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and named in err[0] and "Traceback" not in err[0], err
    assert sorted(p.relative_to(pod) for p in pod.rglob("*")) == before


def test_the_launchers_merge_settings_are_refused_in_env(tmp_path, capsys):
    pod = make_pod(tmp_path)
    config = yaml.safe_load((pod / "fractus-pod.yaml").read_text())
    config["env"]["MERGE_EVERY"] = "1000"
    (pod / "fractus-pod.yaml").write_text(yaml.safe_dump(config))
    assert cli_main(["--pod-dir", str(pod), "launch", "--stage", "1"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "env: MERGE_EVERY is the launcher's to set" in line


def test_checkpoints_outside_the_pod_are_refused_with_rounds(tmp_path):
    pod = make_pod(tmp_path, checkpoints=str(tmp_path / "elsewhere" / "g{i}.pt"))
    set_rounds(pod, {"every_tokens": 100})
    with pytest.raises(UserError, match="merge_rounds needs the checkpoints inside the pod"):
        load_plan(pod, 1, "cpu:2", None)


def test_refused_on_a_ray_pod_saying_why(tmp_path):
    pod = make_pod(tmp_path)
    set_rounds(pod, {"every_tokens": 100})
    with pytest.raises(UserError, match="not supported on a Ray pod"):
        load_plan(pod, 1, "cpu:2", None, ray_address="127.0.0.1:6379")


def test_a_quorum_above_the_launchs_gpus_is_refused(tmp_path):
    pod = make_pod(tmp_path)
    set_rounds(pod, {"every_tokens": 100, "quorum": 3})
    with pytest.raises(UserError, match="quorum 3 is above the 2 GPU"):
        load_plan(pod, 1, "cpu:2", None)
    plan, _ = load_plan(pod, 1, "cpu:3", None)       # three GPUs: it fits
    assert plan.config.merge_round_settings().quorum == 3


def test_the_gate_section_is_shipped_and_checked(tmp_path):
    pod = make_pod(tmp_path, criteria={"merge_gate": {"max_tf_rise": 0.5}})
    gate = load_criteria_file(pod / "manifests" / "trusted_loss.yaml").merge_gate
    assert gate == MergeGate(0.5, 4096, 1, 900.0)
    (pod / "manifests" / "trusted_loss.yaml").write_text(
        yaml.safe_dump({"merge_gate": {"probe": 2}}))
    with pytest.raises(UserError, match="merge_gate.probe must be 0 or 1"):
        load_criteria_file(pod / "manifests" / "trusted_loss.yaml")


GATE = MergeGate(max_tf_rise=0.1, window_tokens=64, probe=1, timeout_s=60)
TOLERANCE = ProbeTolerance(band=0.25, relativeBand=None, k=3.0, offManifoldAcc=0.01)


def test_the_gate_passes_within_the_band_and_refuses_above_it():
    ok, why, record = judge({0: {"own_tf": 3.0, "merged_tf": 3.05},
                             1: {"own_tf": 3.2, "merged_tf": 3.1}}, GATE, None, TOLERANCE)
    assert ok and "worst +0.0500, GPU 0" in why
    assert math.isclose(record["gpus"]["1"]["rise"], -0.1)
    ok, why, _ = judge({0: {"own_tf": 3.0, "merged_tf": 3.05},
                        1: {"own_tf": 3.0, "merged_tf": 3.2}}, GATE, None, TOLERANCE)
    assert not ok and "GPU 1's next-window loss rises by 0.2000" in why


def test_the_gate_refuses_a_non_finite_loss_and_a_failed_probe():
    ok, why, _ = judge({0: {"own_tf": 3.0, "merged_tf": float("nan")}}, GATE, None, TOLERANCE)
    assert not ok and "not finite" in why
    probe = {"ar": 9.0, "ar_acc": 0.1, "ar_rows": [9.0, 9.0, 9.0, 9.0], "rows": 4,
             "vocab_size": 512}
    ok, why, record = judge({0: {"own_tf": 3.0, "merged_tf": 3.0, "probe": probe}}, GATE,
                            {"ar": 5.0, "ar_rows": [5.0, 5.1, 4.9, 5.0]}, TOLERANCE)
    assert not ok and "AR probe failed" in why and record["probe"]["status"] == "Failed"
    # No baseline: the probe cannot judge, the band alone decides.
    ok, _, record = judge({0: {"own_tf": 3.0, "merged_tf": 3.0, "probe": probe}}, GATE, None,
                          TOLERANCE)
    assert ok and record["probe"]["status"] == "Inconclusive"


def good_ledger():
    return {"format": "fractus-pod-rounds-v1", "origins": {"1": {"0": 0, "1": 0}},
            "rounds": [{"round": 1, "stage": 1, "boundary": 1, "state": "adopted",
                        "gpus": {"0": {"at_token": 96, "checkpoint": "checkpoints/g0.pt",
                                       "sha256": "a" * 64, "tokens": 96}},
                        "left_out": [1], "weights": [1.0], "merged": "merge/round_00001.pt",
                        "merged_sha256": "b" * 64}]}


@pytest.mark.parametrize("spoil, named", [
    (lambda d: d["rounds"][0].update(round=2), "not the record of round 1"),
    (lambda d: d["rounds"][0].update(state="maybe"), "state"),
    (lambda d: d["rounds"][0].update(merged="/etc/passwd"),
     "merged '/etc/passwd' is not a round file inside merge/"),
    (lambda d: d["rounds"][0].update(merged=None), "adopted, with no merged file"),
    (lambda d: d["rounds"][0]["gpus"]["0"].update(checkpoint="../../x.pt"), "checkpoint"),
    (lambda d: d["rounds"][0]["gpus"]["0"].update(sha256="zz"), "sha256"),
    (lambda d: d["rounds"][0]["gpus"]["0"].update(at_token=-1), "at_token"),
    (lambda d: d["rounds"][0].update(weights=[float("nan")]), "weights"),
    (lambda d: d["rounds"][0].update(boundary=0), "boundary"),
    (lambda d: d["origins"].update({"1": {"x": 0}}), "origins"),
    (lambda d: d.update(format="v0"), "is not a fractus-pod-rounds-v1 ledger"),
])
def test_one_ledger_reader_refuses_each_malformed_field_in_one_line(spoil, named):
    from launcher.pod.rounds_ledger import LedgerError, check_ledger
    assert check_ledger(good_ledger())["rounds"][0]["round"] == 1
    data = good_ledger()
    spoil(data)
    with pytest.raises(LedgerError) as refused:
        check_ledger(data)
    assert named in str(refused.value) and "\n" not in str(refused.value)


def test_launch_refuses_a_malformed_ledger_before_anything(tmp_path, capsys):
    pod = make_pod(tmp_path)
    set_rounds(pod, {"every_tokens": 100})
    (pod / "merge").mkdir()
    (pod / "merge" / "rounds.json").write_text('{"format": "fractus-pod-rounds-v1"}')
    before = sorted(p.relative_to(pod) for p in pod.rglob("*"))
    assert cli_main(["--pod-dir", str(pod), "launch", "--stage", "1"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "merge/rounds.json" in line and "move merge/ aside" in line
    assert sorted(p.relative_to(pod) for p in pod.rglob("*")) == before
