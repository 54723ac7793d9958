"""The stage canary: real worker processes on a tiny CPU pod, plus the pure comparisons.

The pod (a copy per module of tests/conftest.py's worker_trained_pod): `init --preset
tiny-cpu`, one synthetic shard, 3 steps trained at stage 1 by the real worker, the manifest
written from its checkpoint event (as the launcher does). Each canary then runs two real
workers from that checkpoint.
"""

import hashlib
import json
import os
from pathlib import Path

import pytest
import yaml

from launcher.checks.canary import run_canary
from launcher.paths import CANARY_SCRATCH_DIR
from launcher.checks.canary_compare import Tolerance, compare_approximate, compare_exact
from launcher.checks.trusted_loss import load_criteria_file, shipped_criteria_file
from launcher.errors import UserError
from launcher.pod.manifest import read_manifest
from launcher.config.podconfig import DEFAULT_MANIFESTS, load_pod_config
from launcher.worker.process import read_records

from tests.support.pods import copy_pod, launch_plan
from tests.support.wrong_kernel import WRONG_KERNEL

STEPS = 4


@pytest.fixture(scope="module")
def pod(worker_trained_pod, tmp_path_factory) -> Path:
    return copy_pod(worker_trained_pod, tmp_path_factory.mktemp("pod") / "pod")


def snapshot(pod: Path) -> dict:
    """Every file of the pod outside the canary's scratch dir: path -> sha256."""
    scratch = pod / CANARY_SCRATCH_DIR
    return {str(p.relative_to(pod)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(pod.rglob("*")) if p.is_file() and scratch not in p.parents}


def start_events(pod: Path, result) -> dict:
    """stage number -> the `start` event its canary worker wrote."""
    out = {}
    for stage in (result.from_stage, result.to_stage):
        records = read_records(pod / result.scratch / f"stage{stage}" / "metrics.jsonl")
        out[stage] = next(r for r in records if r.get("event") == "start")
    return out


def check_untouched(pod: Path, before: dict, result) -> None:
    assert snapshot(pod) == before       # manifest, canonical checkpoint, logs: unchanged
    assert not list((pod / result.scratch).rglob("*.pt*"))   # scratch weights removed


# ---- real processes ----------------------------------------------------------------------
def test_canary_passes_stage_1_to_2_sequentially(pod, monkeypatch, capsys):
    import launcher.pod.progress
    monkeypatch.setattr(launcher.pod.progress, "PLAIN_FIRST_S", 0.0)   # every progress line
    monkeypatch.setattr(launcher.pod.progress, "PLAIN_EVERY_S", 0.0)
    before = snapshot(pod)
    entry = read_manifest(pod / load_pod_config(pod).manifest).entries[0]
    result = run_canary(*launch_plan(pod), gpu=0, from_stage=1, to_stage=2, steps=STEPS,
                        device="cpu")
    assert result.passed and result.exact and result.status == "Successful", result.reason
    # It says which stage runs and at which step, while it runs.
    progress = capsys.readouterr().out
    assert "canary stage 1 -> 2 on GPU 0: stage 1 loading the model" in progress
    assert f"canary stage 1 -> 2 on GPU 0: stage 2 step {STEPS}/{STEPS}" in progress
    assert f"{2 * STEPS}/{2 * STEPS} steps (100%), done in" in progress
    assert [row.step for row in result.per_step] == [4, 5, 6, 7]      # checkpoint was at step 3
    assert all(row.ok for row in result.per_step)
    starts = start_events(pod, result)
    # Both runs resumed the manifest's checkpoint at its token, with SS off, and really
    # differ in the setting the stage changes (otherwise the comparison proves nothing).
    for event in starts.values():
        assert event["resume"] == "full" and event["next_token"] == entry["start_token"]
        assert event["settings"]["ss_rate"] == 0.0
        assert Path(event["settings"]["ckpt_out"]).parent.parent == pod / result.scratch
    assert (starts[1]["settings"]["ce_chunk"], starts[2]["settings"]["ce_chunk"]) == (0, 2048)
    check_untouched(pod, before, result)
    event = json.loads(json.dumps(result.to_dict()))      # ready for logs/events.jsonl
    assert event["per_step"][0]["tf_from"] == result.per_step[0].tf_from


def test_canary_passes_stage_2_to_3_in_parallel(pod):
    before = snapshot(pod)
    result = run_canary(*launch_plan(pod), gpu=0, from_stage=2, to_stage=3, steps=STEPS,
                        device="cpu", parallel=True)
    assert result.passed and result.exact, result.reason
    assert len(result.per_step) == STEPS
    starts = start_events(pod, result)
    assert starts[2]["settings"]["attn_impl"] == "cumsum"
    assert starts[3]["settings"]["attn_impl"] == "chunked"
    check_untouched(pod, before, result)


def test_a_wrong_kernel_fails_the_canary_and_nothing_switches(pod, tmp_path, monkeypatch):
    plugin = tmp_path / "plugin"
    plugin.mkdir()
    (plugin / "sitecustomize.py").write_text(WRONG_KERNEL)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (str(plugin), os.environ.get("PYTHONPATH")) if p))
    table = yaml.safe_load((pod / "manifests" / "stages.yaml").read_text())
    table["stages"][3]["settings"]["FRACTUS_ATTN_IMPL"] = "halfcarry"   # still marked exact
    stages_path = tmp_path / "stages.yaml"
    stages_path.write_text(yaml.safe_dump(table))
    before = snapshot(pod)

    result = run_canary(*launch_plan(pod, stages_path), gpu=0, from_stage=2, to_stage=3,
                        steps=STEPS, device="cpu", parallel=True)

    assert not result.passed and result.status == "Failed" and result.exact
    assert start_events(pod, result)[3]["settings"]["attn_impl"] == "halfcarry"
    bad = result.per_step[-1]
    assert not bad.ok and bad.tf_from != bad.tf_to
    assert result.reason.startswith(f"step {bad.step}: tf ")
    assert repr(bad.tf_from) in result.reason and repr(bad.tf_to) in result.reason
    check_untouched(pod, before, result)


def test_approximate_stage_runs_the_trusted_loss_checks(pod, tmp_path):
    # Stage 4 without COMPILE (compiling on this CPU takes minutes): batch 8, approximate.
    table = yaml.safe_load((pod / "manifests" / "stages.yaml").read_text())
    table["stages"][4]["settings"]["COMPILE"] = 0
    stages_path = tmp_path / "stages.yaml"
    stages_path.write_text(yaml.safe_dump(table))
    result = run_canary(*launch_plan(pod, stages_path), gpu=0, from_stage=3, to_stage=4,
                        steps=STEPS, device="cpu", parallel=True)
    assert result.passed and not result.exact, result.reason
    assert "trusted-loss checks" in result.reason
    records = read_records(pod / result.scratch / "stage4" / "metrics.jsonl")
    assert any(r.get("event") == "batch_change" for r in records)      # BATCH 4 -> 8
    start = next(r for r in records if r.get("event") == "start")
    assert start["settings"]["batch"] == 8 and start["settings"]["ss_rate"] == 0.25


def test_a_reference_run_that_cannot_start_is_inconclusive(pod, tmp_path):
    table = yaml.safe_load((pod / "manifests" / "stages.yaml").read_text())
    table["stages"][1]["settings"]["BATCH"] = "x"     # the worker exits 2 at once
    stages_path = tmp_path / "stages.yaml"
    stages_path.write_text(yaml.safe_dump(table))
    result = run_canary(*launch_plan(pod, stages_path), gpu=0, from_stage=1, to_stage=2,
                        steps=STEPS, device="cpu")
    assert not result.passed and result.status == "Inconclusive"
    assert "reference run failed" in result.reason and "exited 2" in result.reason
    assert "BATCH" in result.reason
    # Sequential: with nothing to compare against, stage 2 was never started.
    assert not (pod / result.scratch / "stage2").exists()


def test_a_run_over_the_timeout_is_killed(pod):
    result = run_canary(*launch_plan(pod), gpu=0, from_stage=1, to_stage=2, steps=STEPS,
                        device="cpu", timeout_s=1.0)
    assert not result.passed and result.status == "Inconclusive"
    assert "stage 1 timed out (killed)" in result.reason and result.seconds < 30
    assert not (pod / result.scratch / "stage2").exists()


@pytest.mark.parametrize("kwargs, message", [
    ({"from_stage": 2, "to_stage": 2}, "must be >"),
    ({"from_stage": 3, "to_stage": 1}, "must be >"),
    ({"from_stage": 1, "to_stage": 9}, "unknown stage 9"),
    ({"from_stage": 1, "to_stage": 2, "steps": 1}, "steps must be >= 2"),
    ({"from_stage": 1, "to_stage": 2, "device": "tpu"}, "cpu or cuda"),
])
def test_user_mistakes_raise_before_anything_runs(pod, kwargs, message):
    before = snapshot(pod)
    with pytest.raises(UserError, match=message):
        run_canary(*launch_plan(pod), gpu=0, **kwargs)
    assert snapshot(pod) == before


# ---- the comparisons (pure) --------------------------------------------------------------
def records(tfs, lbs=None, start_step=10, tokens=100, ema=None):
    lbs = lbs or [2.0] * len(tfs)
    out, e = [], ema
    for i, (tf, lb) in enumerate(zip(tfs, lbs)):
        e = None if tf is None else tf if e is None else 0.98 * e + 0.02 * tf
        out.append({"type": "metrics", "step": start_step + i, "next_token": (i + 1) * tokens,
                    "tf": tf, "ema_tf": e, "lb": lb, "grad_norm": 1.0, "ss": None,
                    "ema_ss": None})
    return out


TOL = Tolerance(rtol=1e-4)


def test_compare_exact_accepts_rounding_and_names_the_first_bad_step():
    ref = records([5.0, 4.9, 4.8])
    ok, reason, rows = compare_exact(ref, records([5.0, 4.9 * (1 + 5e-5), 4.8]), TOL, 3)
    assert ok and len(rows) == 3 and "3 steps" in reason
    ok, reason, rows = compare_exact(ref, records([5.0, 4.9 * (1 + 2e-4), 4.8 * 1.1]), TOL, 3)
    assert not ok and reason.startswith("step 11: tf 4.9 (stage M) vs ")
    assert [r.ok for r in rows] == [True, False]


def test_compare_exact_checks_the_gradient_norm():
    ref, new = records([5.0, 4.9]), records([5.0, 4.9])
    new[1]["grad_norm"] = 1.001
    ok, reason, rows = compare_exact(ref, new, TOL, 2)
    assert not ok and reason.startswith("step 11: grad_norm 1.0 (stage M) vs 1.001 (stage N)")
    assert rows[-1].grad_norm_to == 1.001


def test_compare_exact_checks_lb_too_and_absolute_tolerance():
    ref = records([5.0, 4.9], lbs=[0.0, 2.0])
    ok, reason, _ = compare_exact(ref, records([5.0, 4.9], lbs=[1e-6, 2.0]), TOL, 2)
    assert not ok and reason.startswith("step 10: lb 0.0")
    ok, _, _ = compare_exact(ref, records([5.0, 4.9], lbs=[1e-6, 2.0]), Tolerance(1e-4, 1e-5), 2)
    assert ok


@pytest.mark.parametrize("new, message", [
    (records([5.0, None]), "step 11: tf 4.9 (stage M) vs None"),
    (records([5.0, 4.9], tokens=200), "read different tokens"),
    (records([5.0]), "step 11: stage N logged no metrics"),
    (records([5.0, 4.9], start_step=11), "step 10: stage N logged no metrics"),
])
def test_compare_exact_refuses_what_cannot_match(new, message):
    ok, reason, _ = compare_exact(records([5.0, 4.9]), new, TOL, 2)
    assert not ok and message in reason


def test_compare_approximate():
    ref, crit = records([5.0, 4.9, 4.8], ema=5.0), shipped_criteria_file().criteria
    ok, reason, _ = compare_approximate(ref, records([5.1, 4.95, 4.9], ema=5.0), crit, 3, 0.15, 5.0)
    assert ok, reason
    ok, reason, _ = compare_approximate(ref, records([5.0, None, 4.9], ema=5.0), crit, 3, 0.15)
    assert not ok and "trusted-loss" in reason and "tf=null" in reason
    ok, reason, _ = compare_approximate(ref, records([12.0] * 3, ema=5.0), crit, 3, 0.05, 5.0)
    assert not ok and "maxEmaTfRise 0.05" in reason
    ok, reason, _ = compare_approximate(ref, records([5.0], ema=5.0), crit, 3, 0.15)
    assert not ok and "1 of 3 steps" in reason


def test_canary_settings_from_the_criteria_file(tmp_path):
    repo_file = DEFAULT_MANIFESTS / "trusted_loss.yaml"
    settings = load_criteria_file(repo_file).canary          # with or without a canary: section
    assert settings.steps >= 2 and settings.exact["cpu"].rtol > 0
    data = yaml.safe_load(repo_file.read_text())
    data["canary"] = {"steps": 7, "exact": {"cuda": {"rtol": 0.03, "atol": 0.01}},
                      "approximate": {"maxEmaTfRise": 0.2}}
    path = tmp_path / "criteria.yaml"
    path.write_text(yaml.safe_dump(data))
    trusted = load_criteria_file(path)
    settings, criteria = trusted.canary, trusted.criteria
    assert settings.steps == 7 and settings.max_ema_tf_rise == 0.2
    assert settings.exact["cuda"] == Tolerance(0.03, 0.01)
    assert settings.exact["cpu"] == shipped_criteria_file().canary.exact["cpu"]
    assert criteria.trend.tolerance == data["checks"]["trend"]["tolerance"]
    for bad in ({"stepz": 3}, {"steps": 1}, {"exact": {"tpu": {"rtol": 1}}},
                {"exact": {"cpu": {"rtol": -1}}}, {"approximate": {"maxRise": 1}}):
        path.write_text(yaml.safe_dump({**data, "canary": bad}))
        with pytest.raises(UserError, match="canary"):
            load_criteria_file(path)
