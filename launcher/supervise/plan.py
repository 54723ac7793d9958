"""The launch plan: every file a person writes for a pod, read, validated and typed once.

`launch` builds it first (load_plan): fractus-pod.yaml (PodConfig, with its `sync:` and
`ray:` sections typed), the stage table, the criteria file (TrustedLoss: the checks, the
supervision policy, the peers, the canary and the probe sections, over the shipped
defaults) and the resume manifest; any mistake in any of them is refused here, in one line,
before anything is written, and so is a `sync:` that would commit past the hf:// repo's
hourly budget (launcher/hub/commit_budget.py). Everything after takes the plan, or the
typed part it needs, never a path: the canary gate (launcher/checks/canary.py: config,
stages, trusted), the probe monitor (trusted.probe_schedule / probe_tolerance), the health
checks and the restart policy (criteria), the hub sync (sync), the Ray backend (ray). None
of them opens those files again during the launch (tests/test_launch_plan.py changes them
under a built plan).

The manifest comes back beside the plan, not in it: it is the pod's state, which the launch
keeps rewriting (reconcile, restores, every checkpoint); the plan never changes (frozen).
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from launcher.checks.criteria import Criteria
from launcher.checks.trusted_loss import TrustedLoss, load_trusted_loss
from launcher.config.devices import Slot, parse_devices
from launcher.config.podconfig import PodConfig, SyncSettings, check_model, load_config
from launcher.config.ray_settings import RaySettings
from launcher.config.stages import Stage, get_stage, load_stages
from launcher.errors import UserError
from launcher.hub.commit_budget import check_commit_budget
from launcher.pod.manifest import Manifest, name_default_checkpoints, read_manifest
from fractus.train.env import SettingsError, WorkerSettings


@dataclass(frozen=True)
class LaunchPlan:
    pod_dir: Path
    config: PodConfig
    stages: dict[int, Stage]
    # The whole criteria file: checks, supervision, peers, canary, probe (`criteria` below).
    trusted: TrustedLoss
    sync: SyncSettings              # the config's `sync:`, parsed
    ray: RaySettings | None         # the config's `ray:` or --ray; None: workers on this machine
    stage: int
    slots: tuple[Slot, ...]
    max_time: float | None = None
    max_steps: int | None = None
    faults: dict = field(default_factory=dict)   # gpu -> FRACTUS_FAULT for its first start
    # time.monotonic() at which --max-time ends the launch: counted from the start of
    # `launch`, so a canary before the workers spends it too.
    deadline: float | None = None

    @property
    def criteria(self) -> Criteria:
        """The health checks, the supervision policy and the peers of the criteria file."""
        return self.trusted.criteria


def load_plan(pod_dir: Path, stage: int | None, devices: str | None, gpus: str | None,
              max_time: float | None = None, max_steps: int | None = None,
              faults: dict | None = None, ray_address: str | None = None
              ) -> tuple[LaunchPlan, Manifest]:
    """The plan and the manifest as it is on disk; UserError (one line) for any mistake."""
    config = load_config(pod_dir)
    check_model(pod_dir, config)
    stages = load_stages(pod_dir / config.stages)
    trusted = load_trusted_loss(pod_dir / config.criteria)
    slots = tuple(parse_devices(devices or config.devices, gpus))
    manifest = read_manifest(pod_dir / config.manifest)
    name_default_checkpoints(manifest, pod_dir, config.checkpoint_path)
    if stage is None:
        stage = manifest.recorded_stage() or 1
    check_worker_settings(stages, stage, config, pod_dir / config.stages)
    if max_time is not None and not 0 < max_time < math.inf:
        raise UserError(f"--max-time must be a number of seconds > 0, got {max_time}; e.g. "
                        f"--max-time 3600")
    for gpu in (faults or {}):
        if gpu not in {s.gpu for s in slots}:
            raise UserError(f"--fault names GPU {gpu}, which this launch does not run; name "
                            f"one of {sorted(s.gpu for s in slots)}")
    plan = LaunchPlan(pod_dir, config, stages, trusted, config.sync_settings(),
                      RaySettings.parse(config.ray, ray_address), stage, slots, max_time,
                      max_steps, dict(faults or {}),
                      None if max_time is None else time.monotonic() + max_time)
    # The hub's commit budget: refused above it (UserError), said near it or on Ray.
    note = check_commit_budget(config.hub, plan.sync, len(slots), plan.ray is not None)
    if note:
        print(f"fractus-pod: {note}", file=sys.stderr, flush=True)
    return plan, manifest


def check_worker_settings(stages: dict[int, Stage], number: int, config: PodConfig,
                          stages_path: Path) -> None:
    """The stage's settings and the config's `env`, parsed by the worker's own
    WorkerSettings now: a bad value (BATCH: x) is refused before anything starts, not by
    every worker after launch."""
    stage = get_stage(stages, number)
    try:
        WorkerSettings.from_env({**stage.settings, **config.env})
    except SettingsError as exc:
        raise UserError(f"{stages_path}: stage {number} (with fractus-pod.yaml env): {exc}") \
            from None
