"""The bodies of the steps launcher/cli/launch_steps.py runs, in its order, before any worker
starts: any problem raises UserError (one line, exit 2) and no worker starts."""

from __future__ import annotations

import dataclasses
import uuid

from launcher.pod.ckpt_trust import check_entry
from launcher.errors import PodBusy, UserError
from launcher.pod.manifest import (
    RUN_ID_KEY,
    Manifest,
    validate_for_launch,
    write_manifest,
)
from launcher.pod.shards import shard_length
from launcher.supervise.plan import LaunchPlan, check_worker_settings
from launcher.worker.process import busy_cuda_gpus, running_workers
from launcher.hub.sync import store_for
from launcher.hub.sync_state import read_sync_state
from launcher.hub.lease import RunTakenOver, refuse_if_taken_over
from launcher.hub import HubError
from launcher.supervise.custodian import CheckpointCustodian
from launcher.supervise.launch_shards import refuse_missing_shards


def refuse_budget_below_one_push(plan: LaunchPlan, manifest: Manifest) -> None:
    """Refuse a retention.budget below one push (the checkpoints the manifest names on this
    disk: each push carries every GPU's), else the hub refuses each push hours later while
    the pod trains unprotected. A new pod's first push says it (retention.check_budget)."""
    settings = plan.config.retention_settings() if plan.config.hub else None
    if settings is None or settings.budget_bytes is None:
        return
    sizes = {}
    for entry in manifest.entries.values():
        path = plan.pod_dir / entry.checkpoint if entry.checkpoint else None
        if path is not None and path.is_file():
            sizes[path.resolve()] = path.stat().st_size
    too_small = settings.below_one_push(sum(sizes.values()),
                                        f"the {len(sizes)} checkpoint(s) the manifest names")
    if too_small:
        raise UserError(too_small)


def refuse_taken_over(plan: LaunchPlan, train_anyway: str) -> None:
    """Refuse when another pod writes the run on the hub (every push would be refused),
    naming `train_anyway`, the command that trains without the hub. Decided by the lease at
    the hub's head; an unreadable hub only by this pod's record of a refused push to it."""
    if not plan.config.hub:
        return
    try:
        refuse_if_taken_over(store_for(plan.config, plan.pod_dir), plan.pod_dir)
        return
    except RunTakenOver as exc:
        message = str(exc)
    except HubError:
        state = read_sync_state(plan.pod_dir)
        message = state.get("taken_over") if state.get("hub") == plan.config.hub else None
        if not message:
            return          # the pushes will say whether the hub takes them
    raise UserError(f"hub {plan.config.hub}: {message}, so no worker started. To train "
                    f"without the hub anyway (checkpoints only in {plan.pod_dir}): "
                    f"{train_anyway}")


def refuse_if_busy(plan: LaunchPlan) -> None:
    wanted = {s.gpu for s in plan.slots}
    ours = {g: pid for g, pid in running_workers(plan.pod_dir).items() if g in wanted}
    if ours:
        gpu, pid = sorted(ours.items())[0]
        raise PodBusy(f"a worker (pid {pid}) already runs on GPU {gpu} of this pod; "
                      f"stop it before launching")
    cuda = busy_cuda_gpus([s.gpu for s in plan.slots if s.device == "cuda"])
    if cuda:
        gpu, pids = sorted(cuda.items())[0]
        raise PodBusy(f"GPU {gpu} already runs process(es) {pids}; refusing to share it")


def complete_decided_rollback(plan: LaunchPlan, manifest: Manifest,
                              custodian: CheckpointCustodian, stage_given: bool) -> LaunchPlan:
    """Complete a rollback the last launcher decided and died carrying out (the custodian's
    `complete_decided_rollback`). Returns the plan, at the target stage when the launch gave
    no --stage."""
    to_stage = custodian.complete_decided_rollback()
    if to_stage is None or stage_given:
        return plan
    plan = dataclasses.replace(
        plan, stage=manifest.recorded_stage([s.gpu for s in plan.slots]) or to_stage)
    check_worker_settings(plan.stages, plan.stage, plan.config,
                          plan.pod_dir / plan.config.stages)
    return plan


def validate(plan: LaunchPlan, manifest: Manifest, on_hub: set[int] = frozenset(),
             on_nodes: set[int] = frozenset()) -> None:
    """`on_hub`: GPUs whose node fetches their checkpoint; `on_nodes`: GPUs whose node
    fetches their shards (plan.shards_on_nodes): neither is looked for on this machine."""
    refuse_missing_shards(plan, manifest, on_nodes)
    validate_for_launch(manifest, plan.pod_dir, [s.gpu for s in plan.slots],
                        plan.config.shard_path, shard_length, on_hub=on_hub,
                        shards_elsewhere=on_nodes)
    refuse_fresh_starts(plan, manifest)
    for slot in plan.slots:
        if slot.gpu not in on_hub:
            check_entry(manifest, plan.pod_dir, slot.gpu, plan.config.shard_path,
                        plan.config.model)


def refuse_fresh_starts(plan: LaunchPlan, manifest: Manifest) -> None:
    """A GPU with no checkpoint named or on disk would train a new random model: only with
    env ALLOW_FRESH_START: "1" in the pod config (as the demo preset)."""
    if plan.config.env.get("ALLOW_FRESH_START") == "1":
        return
    for slot in plan.slots:
        gpu = slot.gpu
        entry = manifest.entries.get(gpu)
        if (entry and entry.checkpoint) or \
                (plan.pod_dir / plan.config.checkpoint_path(gpu)).is_file():
            continue
        known = "names no checkpoint for it" if entry else "does not list it"
        raise UserError(f"gpu {gpu}: {manifest.path.name} {known} and there is no "
                        f"{plan.config.checkpoint_path(gpu)}: nothing to resume from; adopt it "
                        f"with `fractus-pod adopt --init-new-from PATH`, or set env: "
                        f"ALLOW_FRESH_START: \"1\" in fractus-pod.yaml to train a new model")


def ensure_run_id(manifest: Manifest) -> None:
    """Name the run once: workers record it, so another run's checkpoint is recognised."""
    if not manifest.extra.get(RUN_ID_KEY):
        manifest.extra[RUN_ID_KEY] = uuid.uuid4().hex
        write_manifest(manifest)
