"""`launch` never starts a pod whose configuration alone commits past its hf:// repo's
budget (`sync.commits_per_hour`, default HUB_COMMITS_PER_HOUR = 128): refused with the
arithmetic; above WARN_SHARE, or on Ray, a warning. Owner: the hub sync; Ray's recovery
pushers take their share (RECOVERY_SHARE) from here. On one machine the sync commits
3600/interval an hour; on Ray each passed checkpoint costs NODE_COMMITS_PER_PASS, bounded by
what the budget leaves (`CommitPlan.node_pass_every_s`). file:// has no budget."""

from __future__ import annotations

from dataclasses import dataclass

from launcher.config.podconfig import HUB_COMMITS_PER_HOUR, SyncSettings
from launcher.errors import UserError

HOUR_S = 3600.0
RECOVERY_SHARE = 0.25    # of the budget, the most Ray's recovery copies commit an hour
WARN_SHARE = 0.75        # a configuration above this share of the budget is warned about
NODE_COMMITS_PER_PASS = 2    # on Ray: the node's push of a passed checkpoint, the manifest

__all__ = ["HUB_COMMITS_PER_HOUR", "CommitPlan", "check_commit_budget", "commit_plan",
           "recovery_commits_per_hour"]


def recovery_commits_per_hour(budget: int = HUB_COMMITS_PER_HOUR) -> float:
    """The most commits an hour a Ray pod's recovery copies may make, all nodes together."""
    return budget * RECOVERY_SHARE


@dataclass(frozen=True)
class CommitPlan:
    """The commits an hour a configuration makes, by source, and its budget."""
    interval_s: float
    gpus: int
    ray: bool
    budget: int
    recovery_per_hour: float

    @property
    def fixed_per_hour(self) -> float:
        """Commits/hour of the configuration alone (interval pushes; on Ray recovery copies)."""
        return self.recovery_per_hour if self.ray else HOUR_S / self.interval_s

    @property
    def node_pass_every_s(self) -> float | None:
        """On Ray: seconds between each GPU's passes the budget allows; None off Ray or none left."""
        left = self.budget - self.fixed_per_hour
        if not self.ray or left <= 0:
            return None
        return HOUR_S * NODE_COMMITS_PER_PASS * max(1, self.gpus) / left

    def arithmetic(self) -> str:
        """The sum, as a person checks it."""
        if self.ray:
            return f"{self.recovery_per_hour:.0f} recovery-copy commits/hour"
        return (f"one push every {self.interval_s:g}s = 3600/{self.interval_s:g} = "
                f"{self.fixed_per_hour:.0f} commits/hour")

    def interval_that_fits(self) -> int:
        """The shortest sync.interval, in whole seconds, whose pushes fit in the budget."""
        return int(HOUR_S // self.budget) + (1 if HOUR_S % self.budget else 0)


def commit_plan(settings: SyncSettings, gpus: int, ray: bool,
                recovery_per_hour: float | None = None) -> CommitPlan:
    """The plan of `settings` (sync:); `recovery_per_hour` defaults to its budget share."""
    budget = settings.commits_per_hour
    recovery = recovery_commits_per_hour(budget) if recovery_per_hour is None \
        else float(recovery_per_hour)
    return CommitPlan(settings.interval_s, gpus, ray, budget, recovery)


def check_commit_budget(hub: str | None, settings: SyncSettings, gpus: int, ray: bool,
                        recovery_per_hour: float | None = None) -> str | None:
    """UserError past the budget of an hf:// hub; a warning line near it or on Ray; else None."""
    if not hub or not hub.startswith("hf://"):
        return None
    plan = commit_plan(settings, gpus, ray, recovery_per_hour)
    budget = f"the budget of {plan.budget} commits/hour of {hub} (sync.commits_per_hour)"
    if plan.fixed_per_hour > plan.budget:
        fix = ("lower the recovery copies' rate" if plan.ray else
               f"set sync.interval to {plan.interval_that_fits()} or more in fractus-pod.yaml")
        raise UserError(f"{plan.arithmetic()}, above {budget}; {fix}")
    if plan.ray:
        every = plan.node_pass_every_s
        return (f"hub commits: {plan.arithmetic()} of {budget}; the node pushes (a passed "
                f"checkpoint and its manifest, {NODE_COMMITS_PER_PASS} commits) fit if each "
                f"of the {plan.gpus} GPUs passes one at most every {every:.0f}s"
                if every is not None else f"hub commits: {plan.arithmetic()} leave none of "
                f"{budget} for the node pushes")
    if plan.fixed_per_hour > WARN_SHARE * plan.budget:
        return (f"hub commits: {plan.arithmetic()}, {plan.fixed_per_hour / plan.budget:.0%} "
                f"of {budget}: manifest changes and retries leave little room")
    return None
