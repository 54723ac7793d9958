"""The gate before a stage switch: `launch --stage N` on a pod at stage M < N runs the canary.

Anything but a pass raises a ClickException, so nothing switches (docs/CANARY.md).
"""

from __future__ import annotations

import click


def current_stage(plan, manifest) -> int | None:
    """The lowest stage the manifest records for the GPUs this launch runs (None: new pod)."""
    recorded = [manifest.entries[s.gpu]["stage"] for s in plan.slots
                if manifest.entries.get(s.gpu, {}).get("stage") is not None]
    return min(recorded) if recorded else None


def canary_gate(plan, manifest, events, no_canary: bool) -> None:
    """Before a switch up from stage M to N > M: the canary on the first GPU (docs/CANARY.md).
    Anything but a pass raises, so nothing switches: no worker starts, the manifest keeps M."""
    from launcher.canary import run_canary
    from launcher.status import write_canary_state
    current, slot = current_stage(plan, manifest), plan.slots[0]
    if current is None or plan.stage <= current:
        return
    if no_canary:
        record = {"status": "skipped", "passed": None, "from_stage": current,
                  "to_stage": plan.stage, "gpu": slot.gpu, "reason": "--no-canary"}
        events.emit("canary_skipped", **record)
        write_canary_state(plan.pod_dir, record)
        click.echo(f"canary skipped (--no-canary): stage {current} -> {plan.stage}")
        return
    click.echo(f"canary: stage {current} -> {plan.stage} on GPU {slot.gpu} ({slot.device}) ...")
    result = run_canary(plan.pod_dir, slot.gpu, current, plan.stage, device=slot.device)
    record = result.to_dict()
    events.emit("canary", **record)
    write_canary_state(plan.pod_dir, record)
    if result.passed:
        click.echo(f"canary passed in {result.seconds:.1f}s: {result.reason}")
        return
    stays = f"the pod stays on stage {current} (nothing switched)"
    if result.status == "Failed":
        raise click.ClickException(f"canary FAILED: stage {plan.stage} does not continue stage "
                                   f"{current}'s curve: {result.reason}; {stays}")
    raise click.ClickException(f"canary INCONCLUSIVE (could not judge stage {plan.stage}): "
                               f"{result.reason}; {stays}; fix the cause, or relaunch "
                               f"with --no-canary")
