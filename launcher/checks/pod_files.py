"""The pod's hand-written files (fractus-pod.yaml, stages, criteria), read and typed once,
frozen; LaunchPlan extends it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from launcher.checks.criteria import Criteria
from launcher.checks.trusted_loss import CriteriaFile
from launcher.config.podconfig import PodConfig
from launcher.config.stages import Stage


@dataclass(frozen=True)
class PodFiles:
    pod_dir: Path
    config: PodConfig
    stages: dict[int, Stage]
    # The whole criteria file: checks, supervision, peers, canary, probe (`criteria` below).
    trusted: CriteriaFile

    @property
    def criteria(self) -> Criteria:
        return self.trusted.criteria
