"""The gate before a stage switch up, M < N: the canary (docs/CANARY.md). Anything but a pass
raises Refused (exit 1); a stop meanwhile raises LaunchStopped (exit 0). Either way nothing
switches and the pod stays at stage M."""

from __future__ import annotations

import signal
import time

from launcher.errors import Refused
from launcher.files import sha256_file
from launcher.pod.manifest import write_manifest


class LaunchStopped(Exception):
    """The launch was stopped before supervision began; nothing was switched or started."""


class EarlyStop:
    """A stop before supervision (the canary can take minutes): SIGTERM/SIGINT remembered,
    not fatal; --max-time counts from the start of `launch`."""

    def __init__(self, deadline: float | None):
        self.deadline = deadline
        self.signal: str | None = None

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.signal = f"{signal.Signals(signum).name} received"

    def reason(self) -> str | None:
        if self.signal:
            return self.signal
        if self.deadline is not None and time.monotonic() >= self.deadline:
            return "--max-time reached"
        return None


def stage_before_launch(plan, manifest) -> int | None:
    """The lowest stage the manifest records for the GPUs this launch runs (None: new pod)."""
    return manifest.recorded_stage({s.gpu for s in plan.slots})


def canary_gate(plan, manifest, events, no_canary: bool, stop: EarlyStop) -> None:
    """The canary on the first GPU before a switch up; anything but a pass raises."""
    # Here, not at the top: `launch` imports this module first to install EarlyStop, and
    # the canary's imports (~50 ms) would delay catching a stop.
    from launcher.checks.canary import run_canary
    from launcher.checks.canary import write_canary_state
    current, slot = stage_before_launch(plan, manifest), plan.slots[0]
    if current is None or plan.stage <= current:
        return
    if no_canary:
        record = {"status": "skipped", "passed": None, "from_stage": current,
                  "to_stage": plan.stage, "gpu": slot.gpu, "reason": "--no-canary"}
        events.emit("canary_skipped", **record)
        write_canary_state(plan.pod_dir, record)
        print(f"canary skipped (--no-canary): stage {current} -> {plan.stage}", flush=True)
        return
    ensure_canary_inputs(plan, manifest)    # its shard and checkpoint, on a Ray pod's head too
    print(f"canary: stage {current} -> {plan.stage} on GPU {slot.gpu} ({slot.device}) ...",
          flush=True)
    result = run_canary(plan, manifest, slot.gpu, current, plan.stage, device=slot.device,
                        should_stop=stop.reason)
    record = result.to_dict()
    events.emit("canary", **record)
    write_canary_state(plan.pod_dir, record)
    if result.interrupted:
        raise LaunchStopped(f"stopped during the canary ({result.interrupted}): nothing "
                            f"switched, the pod stays on stage {current}")
    if result.passed:
        print(f"canary passed in {result.seconds:.1f}s: {result.reason}", flush=True)
        return
    stays = f"the pod stays on stage {current} (nothing switched)"
    if result.out_of_memory:
        raise Refused(f"canary FAILED: stage {plan.stage} does not fit in memory: "
                      f"{result.reason}; {stays}; lower stage {plan.stage}'s BATCH in "
                      f"{plan.config.stages}")
    if result.status == "Failed":
        raise Refused(f"canary FAILED: stage {plan.stage} does not continue stage "
                                   f"{current}'s curve: {result.reason}; {stays}")
    raise Refused(f"canary INCONCLUSIVE (could not judge stage {plan.stage}): "
                               f"{result.reason}; {stays}; fix the cause, or relaunch "
                               f"with --no-canary")


def ensure_canary_inputs(plan, manifest) -> None:
    """What the canary reads, here, else Refused (exit 1): with `data:` its shard verified
    again (a decided rollback may have moved the GPU's phase since fetch_shards; a stamped
    shard costs a stat); a hub-only checkpoint pulled to its entry's name and checked
    against its sha256, the entry unchanged (the node pulls it by that name)."""
    # Here, as in canary_gate: launch imports this module before EarlyStop is installed.
    from launcher.supervise.launch_shards import canary_shard, ensure_shards_here
    from launcher.supervise.plan import on_the_hub
    if plan.config.data is not None:
        ensure_shards_here(plan, [canary_shard(plan, manifest)])
    gpu = plan.slots[0].gpu
    if gpu not in on_the_hub(plan, manifest) or not plan.config.hub:
        return
    entry = manifest.entries[gpu]
    from launcher.hub import HubError, open_store
    try:
        open_store(plan.config.hub, plan.pod_dir).pull([entry.checkpoint],
                                                       revision=entry.hub_revision)
    except (HubError, ValueError) as exc:
        raise Refused(f"canary: gpu_{gpu}'s checkpoint {entry.checkpoint} is on the hub only "
                      f"and could not be pulled here to run the canary: {exc}") from None
    if sha256_file(plan.pod_dir / entry.checkpoint) != entry.checkpoint_sha256:
        (plan.pod_dir / entry.checkpoint).unlink()
        raise Refused(f"canary: revision {entry.hub_revision[:12]} of {plan.config.hub} holds "
                      f"other bytes at {entry.checkpoint} than gpu_{gpu}'s manifest entry "
                      f"records; the canary did not run")


def record_stage(manifest, gpus: list[int], stage: int, events) -> bool:
    """Record the launch's stage for its GPUs with progress before any worker starts, so a
    run killed before a GPU's first checkpoint there still resumes at it. True: changed."""
    recorded = manifest.recorded_stages(gpus)
    if not recorded or recorded == [stage]:
        return False
    manifest.set_stage(stage, gpus)
    events.emit("stage_change", from_stage=recorded, to_stage=stage, reason="launch")
    write_manifest(manifest)
    return True
