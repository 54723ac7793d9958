"""Health checks as pure functions over synthetic metrics records."""

import dataclasses
import math

import pytest

from launcher.checks.criteria import Criteria, parse_criteria
from launcher.checks.trusted_loss import load_criteria_file
from launcher.checks.trusted_loss import shipped_criteria_file
from launcher.config.podconfig import DEFAULT_MANIFESTS
from launcher.errors import UserError
from launcher.checks.health import (FAILED, INCONCLUSIVE, RUNNING, SUCCESSFUL, GpuHealth, analyze)


def criteria(**checks) -> Criteria:
    """Small windows so a few dozen records cover them."""
    base = {
        "finite": {"interval": 0, "failureLimit": 0},
        "continuity": {"maxAbsDelta": 0.2},
        "trend": {"interval": 10, "initialDelay": 10, "lookback": 30, "tolerance": 0.1,
                  "failureLimit": 0},
        "lb_band": {"interval": 10, "band": 1.0, "failureLimit": 0},
        "ss_ratio": {"interval": 10, "initialDelay": 10, "maxRatio": 1.5, "failureLimit": 0},
        "loss_spike": {"windowLogs": 5, "factor": 2.0, "patience": 2, "failureLimit": 0},
    }
    for name, override in checks.items():
        base[name] = {**base[name], **override}
    return parse_criteria({"checks": base})


def curve(n, start=6.0, slope=0.02, lb=2.0, ss_ratio=1.1, step0=0):
    """A healthy run: tf and ema_tf going down, lb steady, ema_ss a bit above ema_tf."""
    out, ema = [], None
    for i in range(n):
        tf = start - slope * i
        ema = tf if ema is None else 0.9 * ema + 0.1 * tf
        out.append({"type": "metrics", "step": step0 + i, "tf": tf, "ema_tf": ema,
                    "ss": tf * ss_ratio, "ema_ss": ema * ss_ratio, "lb": lb, "grad_norm": 0.5})
    return out


def test_healthy_run_passes_once_window_is_covered():
    c = criteria()
    assert analyze(c, 40, curve(20)).phase == RUNNING
    verdict = analyze(c, 40, curve(45))
    assert verdict.phase == SUCCESSFUL, verdict
    assert all(v["phase"] == SUCCESSFUL for v in verdict.checks.values())


@pytest.mark.parametrize("field", ["tf", "ema_tf", "lb", "grad_norm", "ema_ss"])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_any_non_finite_value_fails_at_once(field, bad):
    records = curve(30)
    records[12][field] = bad
    verdict = analyze(criteria(), 1000, records)
    assert verdict.phase == FAILED
    assert verdict.reason.startswith("finite:") and field in verdict.reason


def test_nan_event_and_exit_codes_fail():
    assert analyze(criteria(), 100, curve(5) + [{"type": "event", "event": "nan", "step": 5}]
                   ).phase == FAILED
    assert analyze(criteria(), 100, curve(5), exit_code=3).phase == FAILED
    oom = analyze(criteria(), 100, curve(5), exit_code=4)
    assert oom.phase == FAILED and "oom" in oom.reason
    assert analyze(criteria(), 100, curve(5), exit_code=1).phase == RUNNING


def test_continuity_compares_first_log_with_resumed_checkpoint():
    records = curve(5, start=4.0)
    ok = analyze(criteria(), 100, records, resume_ema_tf=4.1)
    assert ok.checks["continuity"]["phase"] != FAILED
    jump = analyze(criteria(), 100, records, resume_ema_tf=3.0)
    assert jump.phase == FAILED and "continuity" in jump.reason


def test_continuity_rearmed_on_each_restart():
    h = GpuHealth(criteria(), 100, resume_ema_tf=None)
    for r in curve(5, start=4.0):
        h.feed(r)
    assert h.phase() != FAILED
    h.start(resume_ema_tf=1.0)       # restarted from a checkpoint far from the curve
    h.feed(curve(1, start=4.0, step0=5)[0])
    assert h.phase() == FAILED


def test_trend_fails_when_ema_tf_climbs_above_window_minimum():
    records = curve(20) + curve(25, start=5.6, slope=-0.05, step0=20)   # goes back up
    verdict = analyze(criteria(), 1000, records)
    assert verdict.phase == FAILED and verdict.reason.startswith("trend:")
    flat_noise = analyze(criteria(), 1000, curve(45, slope=0.0))
    assert flat_noise.phase != FAILED


def test_trend_failure_limit_allows_that_many_failures():
    records = curve(20) + curve(12, start=5.6, slope=-0.05, step0=20)
    assert analyze(criteria(), 1000, records).phase == FAILED
    lenient = criteria(trend={"failureLimit": 5})
    assert analyze(lenient, 1000, records).phase != FAILED


def test_lb_band_uses_previous_stage_baseline():
    records = curve(30, lb=14.0)
    assert analyze(criteria(), 1000, records, lb_baseline=14.5).phase != FAILED
    drifted = analyze(criteria(), 1000, records, lb_baseline=10.0)
    assert drifted.phase == FAILED and "lb_band" in drifted.reason
    relative = criteria(lb_band={"relativeBand": 0.5})
    assert analyze(relative, 1000, records, lb_baseline=10.0).phase != FAILED


def test_lb_band_without_baseline_takes_first_log():
    records = curve(12, lb=2.0) + curve(10, lb=5.0, step0=12)
    verdict = analyze(criteria(), 1000, records)
    assert verdict.phase == FAILED and "first log of this stage" in verdict.reason


def test_ss_ratio_bounded_and_inconclusive_without_ss():
    assert analyze(criteria(), 1000, curve(30, ss_ratio=2.0)).phase == FAILED
    no_ss = [{k: v for k, v in r.items() if k not in ("ss", "ema_ss")} for r in curve(45)]
    verdict = analyze(criteria(), 40, no_ss)
    assert verdict.phase == INCONCLUSIVE and "ss_ratio" in verdict.reason


def test_loss_spike_needs_patience_consecutive_logs():
    records = curve(20, slope=0.0)
    one = [dict(r) for r in records]
    one[10]["tf"] = 20.0                      # a single spike: tolerated (patience 2)
    assert analyze(criteria(), 1000, one).checks["loss_spike"]["phase"] != FAILED
    two = [dict(r) for r in records]
    two[10]["tf"] = two[11]["tf"] = 20.0
    verdict = analyze(criteria(), 1000, two)
    assert verdict.phase == FAILED and "loss_spike" in verdict.reason


def test_verified_step_only_advances_on_clean_periodic_measurements():
    h = GpuHealth(criteria(), 1000)
    for r in curve(25):
        h.feed(r)
    assert h.verified_step == 20          # last tick of the interval-10 checks
    h.feed({**curve(26)[-1], "step": 30, "tf": math.nan})
    assert h.phase() == FAILED
    before = h.verified_step
    h.feed({**curve(31)[-1], "step": 40})
    assert h.verified_step == before


def test_close_out_judges_the_steps_since_the_last_periodic_tick():
    healthy = GpuHealth(criteria(), 1000)
    for record in curve(25):            # periodic ticks at steps 10 and 20; the run ends at 24
        healthy.feed(record)
    assert healthy.verified_step == 20
    healthy.close_out()
    assert healthy.verified_step == 24 and not healthy.failed()

    climbing = GpuHealth(criteria(), 1000)
    records = curve(25)
    for i in (22, 23, 24):               # the last steps climb above the window's minimum
        records[i]["ema_tf"] = records[i]["tf"] = 9.0
    for record in records:
        climbing.feed(record)
    climbing.close_out()
    assert climbing.verified_step == 20 and climbing.failed()


def test_repository_criteria_file_loads_and_thresholds_come_from_it(tmp_path):
    loaded = load_criteria_file(DEFAULT_MANIFESTS / "trusted_loss.yaml").criteria
    assert loaded.restarts.max_restarts >= 1 and loaded.hang.timeout_s > 0
    changed = tmp_path / "c.yaml"
    changed.write_text("checks:\n  ss_ratio: {maxRatio: 9.5}\n")
    assert load_criteria_file(changed).criteria.ss_ratio.maxRatio == 9.5


@pytest.mark.parametrize("text, needle", [
    ("checks:\n  trend: {tolerence: 1}\n", "tolerence"),
    ("checks:\n  nope: {}\n", "nope"),
    ("checks:\n  trend: {interval: -1}\n", ">= 0"),
    ("checks:\n  trend: {interval: 1.5}\n", "integer"),
    ("checks: [1\n", "invalid YAML"),
])
def test_bad_criteria_file_is_a_user_error(tmp_path, text, needle):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(UserError, match=needle):
        load_criteria_file(path)


def test_restart_backoff_doubles_and_caps():
    r = dataclasses.replace(shipped_criteria_file().criteria.restarts, backoff_s=1.0, backoff_max_s=5.0)
    assert [r.backoff(i) for i in (1, 2, 3, 4)] == [1.0, 2.0, 4.0, 5.0]


def test_null_loss_from_strict_json_worker_counts_as_non_finite():
    records = curve(10)
    records[5]["tf"] = None                 # the worker writes NaN as null
    assert analyze(criteria(), 1000, records).phase == FAILED
    no_ss_yet = curve(10)
    no_ss_yet[5]["ss"] = no_ss_yet[5]["ema_ss"] = None
    assert analyze(criteria(), 1000, no_ss_yet).phase != FAILED


def test_loss_spike_ignores_a_non_positive_mean():
    records = curve(20, start=-1.0, slope=0.0)        # not a CE; the ratio means nothing
    assert analyze(criteria(), 1000, records).checks["loss_spike"]["phase"] != FAILED
