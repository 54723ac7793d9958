"""What the files a person writes for a pod say, read and typed once (frozen): the pod
directory, fractus-pod.yaml, the stage table and the criteria file. The launch plan
(launcher/supervise/plan.py LaunchPlan) extends it; the stage canary (canary.py) reads only it.
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
        """The health checks, the supervision policy and the peers of the criteria file."""
        return self.trusted.criteria
