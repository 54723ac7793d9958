"""The criteria file's defaults live in one place: the shipped trusted_loss.yaml.

Issue 17: the code's defaults disagreed with the shipped file (trend interval 0 in code, 100
in the YAML; 8 fields and the probe's `every` differed), so deleting a key from a pod's copy
silently changed a check. Now a key a pod's file leaves out takes the shipped value, and the
parsing code has no default of its own.
"""

import copy
import dataclasses

import pytest
import yaml

from launcher.checks.canary_settings import CanarySettings
from launcher.checks.criteria import CHECKS, Criteria, HangPolicy, RestartPolicy
from launcher.checks.probe_check import ProbeSchedule, ProbeTolerance
from launcher.checks.shipped_defaults import SHIPPED_CRITERIA
from launcher.checks.trusted_loss import load_criteria_file, shipped_criteria_file
from launcher.errors import UserError

SHIPPED = yaml.safe_load(SHIPPED_CRITERIA.read_text())


def leaf_paths(tree, prefix=()):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from leaf_paths(value, prefix + (key,))
        else:
            yield prefix + (key,)


def without(tree, path):
    tree = copy.deepcopy(tree)
    node = tree
    for key in path[:-1]:
        node = node[key]
    del node[path[-1]]
    return tree


@pytest.mark.parametrize("path", list(leaf_paths(SHIPPED)), ids=".".join)
def test_a_key_deleted_from_a_pods_file_takes_the_shipped_value(tmp_path, path):
    criteria = tmp_path / "trusted_loss.yaml"
    criteria.write_text(yaml.safe_dump(without(SHIPPED, path)))
    assert load_criteria_file(criteria) == shipped_criteria_file()


def test_a_section_left_empty_is_the_whole_shipped_section_and_user_values_win(tmp_path):
    criteria = tmp_path / "trusted_loss.yaml"
    criteria.write_text(yaml.safe_dump({"checks": {"trend": None, "lb_band": {
        "band": None, "relativeBand": 0.2}}, "probe": {"every": 3}}))
    got, shipped = load_criteria_file(criteria), shipped_criteria_file()
    assert got.criteria.trend == shipped.criteria.trend
    assert got.criteria.trend.interval == SHIPPED["checks"]["trend"]["interval"] == 100
    assert (got.criteria.lb_band.band, got.criteria.lb_band.relativeBand) == (None, 0.2)
    assert got.criteria.lb_band.interval == shipped.criteria.lb_band.interval
    assert got.probe_schedule.every == 3
    assert got.probe_schedule.parallel == shipped.probe_schedule.parallel


@pytest.mark.parametrize("cls", [*CHECKS.values(), RestartPolicy, HangPolicy, Criteria,
                                 CanarySettings, ProbeTolerance, ProbeSchedule])
def test_the_parsing_code_has_no_default_of_its_own(cls):
    defaulted = [f.name for f in dataclasses.fields(cls)
                 if f.default is not dataclasses.MISSING
                 or f.default_factory is not dataclasses.MISSING]
    assert not defaulted, f"{cls.__name__} defaults {defaulted} in code; put them in " \
                          f"launcher/config/defaults/trusted_loss.yaml"


@pytest.mark.parametrize("section", [{"canary": {"exact": ["cpu"]}},
                                     {"canary": {"exact": "cpu"}},
                                     {"probe": {"every": 1, "evry": 2}}])
def test_a_malformed_canary_or_probe_section_is_one_line_naming_it(tmp_path, section):
    """One typed builder for every section: a list where a mapping belongs, or a misspelt
    key, is a UserError naming the section, never a crash."""
    criteria = tmp_path / "trusted_loss.yaml"
    criteria.write_text(yaml.safe_dump(section))
    with pytest.raises(UserError, match=f"{next(iter(section))}") as raised:
        load_criteria_file(criteria)
    assert len(str(raised.value).splitlines()) == 1
