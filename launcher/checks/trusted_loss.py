"""The criteria file (manifests/trusted_loss.yaml) read once into one CriteriaFile; each
section is typed by the module that owns it, none of which reads a file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from launcher.checks.canary_settings import CanarySettings, parse_canary
from launcher.checks.criteria import Criteria, parse_criteria
from launcher.checks.merge_gate import MergeGate, parse_merge_gate
from launcher.checks.probe_check import ProbeSchedule, ProbeTolerance, parse_probe
from launcher.checks.shipped_defaults import SHIPPED_CRITERIA, with_shipped_defaults
from launcher.config.yamlfile import read_yaml


@dataclass(frozen=True)
class CriteriaFile:
    criteria: Criteria
    canary: CanarySettings
    probe_tolerance: ProbeTolerance
    probe_schedule: ProbeSchedule
    merge_gate: MergeGate


def load_criteria_file(path: str | Path) -> CriteriaFile:
    """Every section of the criteria file; UserError (one line) for any mistake in any."""
    path = Path(path)
    data = with_shipped_defaults(read_yaml(path, "criteria file"))
    criteria = parse_criteria(data, str(path))      # refuses anything but a mapping
    tolerance, schedule = parse_probe(data.get("probe"), path)
    return CriteriaFile(criteria, parse_canary(data.get("canary"), path), tolerance, schedule,
                        parse_merge_gate(data.get("merge_gate"), path))


def shipped_criteria_file() -> CriteriaFile:
    """The shipped file's values: what a pod gets for every key its own file leaves out."""
    return load_criteria_file(SHIPPED_CRITERIA)
