"""The shards a launch needs on this machine, fetched and verified with `data:`
(launcher/hub/fetch.py); missing ones refused in one line."""

from __future__ import annotations

from launcher.errors import Refused, UserError
from launcher.pod.manifest import Manifest, phase_shard
from launcher.pod.setup_init import missing_shards_fix
from launcher.pod.shards import shard_kind_problem, shard_length
from launcher.hub.fetch import check_recorded
from launcher.hub.sync import retry_policy
from launcher.hub import HubError
from launcher.hub.fetch import ensure_shards
from launcher.supervise.plan import LaunchPlan


def shard_paths(plan: LaunchPlan, manifest: Manifest,
                on_nodes: set[int] = frozenset()) -> list[str]:
    """The shards this launch trains on here (GPUs in `on_nodes` aside): per GPU, the one
    of its current data phase (the manifest entry's, else the config's) and every later
    phase's, so that a phase never ends on a shard that is not there hours into the run."""
    paths = []
    for slot in plan.slots:
        if slot.gpu in on_nodes:
            continue
        entry = manifest.entries.get(slot.gpu)
        paths.append((entry.shard if entry else None) or
                     phase_shard(manifest, slot.gpu, plan.config.shard_path))
        paths += plan.config.shard_paths(slot.gpu)[entry.at_phase if entry else 1:]
    return paths


def canary_shard(plan: LaunchPlan, manifest: Manifest) -> str:
    """The one shard the stage canary reads: the first GPU's current phase's."""
    return phase_shard(manifest, plan.slots[0].gpu, plan.config.shard_path)


def head_shards(plan: LaunchPlan, manifest: Manifest, on_nodes: set[int] = frozenset(),
                canary: bool = False) -> list[str]:
    """shard_paths, plus the canary's shard when `canary` (it runs here) and its GPU's node
    fetches its own: the canary runs before any actor exists."""
    paths = shard_paths(plan, manifest, on_nodes)
    if canary and plan.slots[0].gpu in on_nodes:
        paths.append(canary_shard(plan, manifest))
    return paths


def fetch_shards(plan: LaunchPlan, manifest: Manifest,
                 on_nodes: set[int] = frozenset(), canary: bool = False) -> None:
    """With `data:`, head_shards verified or fetched before anything reads them; an
    unreadable store or other bytes refuse in one line. The nodes' shards are only looked
    up in the store's index (check_recorded), so a store they could not use refuses now."""
    ensure_shards_here(plan, head_shards(plan, manifest, on_nodes, canary))
    if plan.config.data is not None and on_nodes:
        check_recorded(shard_paths(plan, manifest), plan.config.data, plan.pod_dir,
                       retry_policy(plan.config))


def ensure_shards_here(plan: LaunchPlan, paths: list[str]) -> None:
    if plan.config.data is None or not paths:
        return
    try:
        ensure_shards(paths, plan.config.data, plan.pod_dir,
                      retry_policy(plan.config))
    except HubError as exc:        # a fetch cut (rerun: it resumes), or other bytes served
        raise Refused(str(exc)) from None


def refuse_missing_shards(plan: LaunchPlan, manifest: Manifest,
                           on_nodes: set[int]) -> None:
    """Refuse all missing shards in one line with the fix, then any unreadable or empty."""
    missing, present = [], []
    for rel in shard_paths(plan, manifest, on_nodes):
        problem = shard_kind_problem(plan.pod_dir / rel)
        if problem:
            raise UserError(problem)
        if not (plan.pod_dir / rel).is_file():
            missing.append(str(rel))
        else:
            present.append(plan.pod_dir / rel)
    if missing:
        raise UserError(missing_shards_fix(plan.pod_dir, missing))
    for path in present:
        if shard_length(path) == 0:
            raise UserError(f"shard {path} holds no tokens; put the GPU's tokens there")
