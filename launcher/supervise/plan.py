"""The launch plan: every file a person writes for a pod, read, validated and typed once by
`load_plan` (any mistake refused in one line before anything is written), and where this
launch's workers, checkpoints and shards are. Frozen: a step that resolves more builds a
new one; nothing after reopens those files. The manifest, the pod's changing state, comes
back beside it, not in it."""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from launcher.checks.pod_files import PodFiles
from launcher.checks.trusted_loss import load_criteria_file
from launcher.config.devices import Slot, parse_devices
from launcher.config.podconfig import PodConfig, SyncSettings, check_model, load_pod_config
from launcher.config.ray_settings import RaySettings
from launcher.config.stages import Stage, get_stage, load_stages
from launcher.errors import UserError
from launcher.hub.commit_budget import check_commit_budget
from launcher.pod.manifest import Manifest, name_default_checkpoints, read_manifest
from fractus.train.env import SettingsError, WorkerSettings


@dataclass(frozen=True)
class LaunchPlan(PodFiles):
    sync: SyncSettings              # the config's `sync:`, parsed
    ray: RaySettings | None         # the config's `ray:` or --ray: RayBackend; None: LocalBackend
    stage: int
    slots: tuple[Slot, ...]
    max_time: float | None = None
    max_steps: int | None = None
    # time.monotonic() at which --max-time ends the launch: counted from the start of
    # `launch`, so a canary before the workers spends it too.
    deadline: float | None = None
    # Not looked for on this machine: see on_the_hub and shards_on_nodes.
    ckpts_on_hub: frozenset[int] = frozenset()
    shards_on_nodes: frozenset[int] = frozenset()


def load_plan(pod_dir: Path, stage: int | None, devices: str | None, gpus: str | None,
              max_time: float | None = None, max_steps: int | None = None,
              ray_address: str | None = None, no_hub: bool = False
              ) -> tuple[LaunchPlan, Manifest]:
    """The plan and the manifest as it is on disk; UserError (one line) for any mistake.
    `no_hub`: this launch trains without the config's hub (fractus-pod.yaml keeps it)."""
    config = load_pod_config(pod_dir)
    check_model(pod_dir, config)
    stages = load_stages(pod_dir / config.stages)
    trusted = load_criteria_file(pod_dir / config.criteria)
    slots = tuple(parse_devices(devices or config.devices, gpus))
    manifest = read_manifest(pod_dir / config.manifest)
    name_default_checkpoints(manifest, pod_dir, config.checkpoint_path)
    if stage is None:
        stage = manifest.recorded_stage() or 1
    check_worker_settings(stages, stage, config, pod_dir / config.stages)
    if max_time is not None and not 0 < max_time < math.inf:
        raise UserError(f"--max-time must be a number of seconds > 0, got {max_time}; e.g. "
                        f"--max-time 3600")
    plan = LaunchPlan(pod_dir, replace(config, hub=None) if no_hub else config, stages,
                      trusted, config.sync_settings(), RaySettings.parse(config.ray, ray_address),
                      stage, slots, max_time, max_steps,
                      None if max_time is None else time.monotonic() + max_time)
    refuse_rounds_that_cannot_run(plan)
    if plan.ray is not None:
        plan = replace(plan, ckpts_on_hub=frozenset(on_the_hub(plan, manifest)),
                       shards_on_nodes=frozenset(shards_on_nodes(plan, True)))
    # The hub's commit budget: refused above it (UserError), said near it or on Ray.
    note = check_commit_budget(plan.config.hub, plan.sync, len(slots), plan.ray is not None)
    if note:
        print(f"fractus-pod: {note}", file=sys.stderr, flush=True)
    return plan, manifest


def refuse_rounds_that_cannot_run(plan: LaunchPlan) -> None:
    """merge_rounds: on a Ray pod, or with a quorum above the launch's GPUs: refused."""
    rounds = plan.config.merge_round_settings()
    if rounds is None:
        return
    if plan.ray is not None:
        raise UserError("merge_rounds is not supported on a Ray pod yet: a round pauses "
                        "every GPU at its boundary and the head merges their checkpoints "
                        "from its own disk; remove merge_rounds: from fractus-pod.yaml, or "
                        "launch without Ray")
    checkpoint = Path(plan.config.checkpoint_path(plan.slots[0].gpu))
    if checkpoint.is_absolute() or ".." in checkpoint.parts:
        raise UserError(f"merge_rounds needs the checkpoints inside the pod dir (the rounds' "
                        f"ledger names them relative to it); checkpoints: "
                        f"{plan.config.checkpoints!r} is not: make it relative, e.g. "
                        f"checkpoints/fractus_1b_gpu{{i}}.pt")
    if rounds.quorum_of(len(plan.slots)) > len(plan.slots):
        raise UserError(f"merge_rounds.quorum {rounds.quorum} is above the {len(plan.slots)} "
                        f"GPU(s) this launch runs: lower it to at most {len(plan.slots)}")


def check_worker_settings(stages: dict[int, Stage], number: int, config: PodConfig,
                          stages_path: Path) -> None:
    """Parse the stage's settings and `env` with the worker's own WorkerSettings, so a bad
    value is refused now, not by every worker after launch."""
    stage = get_stage(stages, number)
    try:
        WorkerSettings.from_env({**stage.settings, **config.env})
    except SettingsError as exc:
        raise UserError(f"{stages_path}: stage {number} (with fractus-pod.yaml env): {exc}") \
            from None


def on_the_hub(plan: LaunchPlan, manifest: Manifest) -> set[int]:
    """On Ray: the GPUs whose checkpoint the hub holds (revision and sha256 recorded) and this
    machine does not. Their node pulls and verifies it; the head never reads it (but for
    the canary's: stage_switch.ensure_canary_inputs)."""
    held = set()
    for slot in plan.slots:
        entry = manifest.entries.get(slot.gpu)
        if entry and entry.checkpoint and entry.checkpoint_sha256 and entry.hub_revision \
                and not (plan.pod_dir / entry.checkpoint).is_file():
            held.add(slot.gpu)
    return held


def shards_on_nodes(plan: LaunchPlan, on_ray: bool) -> set[int]:
    """The GPUs whose shards this machine never needs: on Ray with `data:`, each node fetches
    its GPUs' own (which node a GPU lands on is only known at placement)."""
    return {s.gpu for s in plan.slots} if on_ray and plan.config.data else set()
