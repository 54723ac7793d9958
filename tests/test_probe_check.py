"""The AR probe's verdict against a stage baseline, and the probe run in another process."""

import math

import pytest
import torch
import yaml

from fractus.config import PRESETS
from fractus.continuous_engine import ContinuousThoughtEngine
from fractus.data import synth
from fractus.eval.probe import ProbeConfig, probe_checkpoint
from launcher.errors import UserError
from launcher.health import FAILED, INCONCLUSIVE, SUCCESSFUL
from launcher.probe_check import (ProbeTolerance, ProbeUnavailable, check_probe,
                                  load_probe_tolerance, probe_verdict, run_probe_process)

ABS = ProbeTolerance(band=0.25)
REL = ProbeTolerance(band=0.25, relativeBand=0.10)


def result(ar):
    return {"ar": ar, "ar_acc": 0.1, "cold_tf": 6.0, "start": 0, "rows": 2, "next_token": 0}


# ---- the verdict -------------------------------------------------------------------------
@pytest.mark.parametrize("ar, baseline, tol, status", [
    (5.00, 5.00, ABS, SUCCESSFUL),
    (5.24, 5.00, ABS, SUCCESSFUL),
    (5.25, 5.00, ABS, SUCCESSFUL),      # at the limit: not worse by MORE than the tolerance
    (5.26, 5.00, ABS, FAILED),
    (3.00, 5.00, ABS, SUCCESSFUL),      # better than the baseline
    (5.40, 5.00, REL, SUCCESSFUL),      # relativeBand wins: limit 0.5
    (5.60, 5.00, REL, FAILED),
])
def test_ar_against_its_baseline(ar, baseline, tol, status):
    got, reason = probe_verdict(result(ar), baseline, tol)
    assert got == status
    assert f"{ar:.4f}" in reason and f"{baseline:.4f}" in reason


def test_a_failure_names_the_values():
    status, reason = probe_verdict(result(7.5), 5.0, ABS)
    assert status == FAILED
    assert reason == "AR 7.5000 above baseline 5.0000 by 2.5000 > 0.2500 (band 0.25)"


def test_result_objects_and_dicts_are_both_accepted():
    from fractus.eval.probe import ProbeResult
    obj = ProbeResult(ar=6.0, ar_acc=0.2, cold_tf=6.5, start=0, rows=2, next_token=None)
    assert probe_verdict(obj, 6.0, ABS)[0] == SUCCESSFUL
    assert probe_verdict(obj, 5.0, ABS)[0] == FAILED


@pytest.mark.parametrize("res, baseline, error, status, words", [
    (None, 5.0, None, INCONCLUSIVE, "could not run"),
    (None, 5.0, "probe timed out after 9 s", INCONCLUSIVE, "timed out"),
    (result(5.0), 5.0, "crashed", INCONCLUSIVE, "crashed"),
    (result(5.0), None, None, INCONCLUSIVE, "no finite baseline"),
    (result(5.0), math.nan, None, INCONCLUSIVE, "no finite baseline"),
    (result(math.nan), 5.0, None, FAILED, "not finite"),
    (result(math.inf), None, None, FAILED, "not finite"),
])
def test_cannot_judge_or_broken(res, baseline, error, status, words):
    got, reason = probe_verdict(res, baseline, ABS, error=error)
    assert got == status and words in reason


def test_tolerance_from_the_criteria_file(tmp_path):
    path = tmp_path / "trusted_loss.yaml"
    path.write_text(yaml.safe_dump({"checks": {}}))
    assert load_probe_tolerance(path) == ProbeTolerance()
    path.write_text(yaml.safe_dump({"probe": {"band": 0.5, "relativeBand": 0.02}}))
    assert load_probe_tolerance(path) == ProbeTolerance(0.5, 0.02)
    path.write_text(yaml.safe_dump({"probe": {"relativeBand": None}}))
    assert load_probe_tolerance(path).relativeBand is None
    for bad in ({"band": -1}, {"band": "wide"}, {"bandz": 1}, {"band": True}):
        path.write_text(yaml.safe_dump({"probe": bad}))
        with pytest.raises(UserError, match="probe"):
            load_probe_tolerance(path)
    with pytest.raises(UserError, match="not found"):
        load_probe_tolerance(tmp_path / "missing.yaml")


# ---- the probe in another process ----------------------------------------------------------
@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("probe")
    shard = synth(root, shards=1, tokens=20_000, vocab=PRESETS["tiny"].vocab_size, seed=0)[0]
    torch.manual_seed(3)
    model = ContinuousThoughtEngine.from_config(PRESETS["tiny"])
    ckpt = root / "ckpt.pt"
    torch.save({"model_state": model.state_dict(), "config": model.config.to_dict(),
                "train_state": {"next_token": 1000}}, ckpt)
    return ckpt, shard


def test_probe_process_matches_the_in_process_probe_and_is_judged(files):
    ckpt, shard = files
    here = probe_checkpoint(str(ckpt), shard, ProbeConfig(rows=2))
    good = check_probe(ckpt, shard, baseline_ar=here.ar + 0.1, tolerance=ABS, rows=2)
    assert good.status == SUCCESSFUL, good.reason
    assert good.result["ar"] == pytest.approx(here.ar, rel=1e-6) and good.result["start"] == 1000
    worse = check_probe(ckpt, shard, baseline_ar=here.ar - 1.0, tolerance=ABS, rows=2)
    assert worse.status == FAILED and "above baseline" in worse.reason
    assert worse.result["ar"] == good.result["ar"]        # deterministic across processes


def test_a_probe_that_cannot_run_is_inconclusive(files, tmp_path):
    ckpt, shard = files
    missing = check_probe(tmp_path / "nope.pt", shard, baseline_ar=5.0)
    assert missing.status == INCONCLUSIVE and missing.result is None
    assert "probe exited" in missing.reason and "nope.pt" in missing.reason
    with pytest.raises(ProbeUnavailable, match="timed out"):
        run_probe_process(ckpt, shard, timeout_s=0.05)
