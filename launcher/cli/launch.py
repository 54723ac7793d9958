"""`fractus-pod launch`: its options, parsed; the launch itself is launch_steps.py."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import click

from launcher.cli.options import (check_trust_flag, pod_dir_of, pod_dir_option,
                                  trust_hub_config_option)
from launcher.errors import UserError
from launcher.supervise.stage_switch import EarlyStop


def _parse_faults(values: tuple[str, ...]) -> dict[int, str]:
    faults = {}
    for value in values:
        gpu, sep, spec = value.partition(":")
        if not sep or not gpu.isdigit() or not spec:
            raise UserError(f"--fault expects GPU:KIND@STEP (e.g. 1:nan@30), got {value!r}")
        faults[int(gpu)] = spec
    return faults


@click.command()
@pod_dir_option
@click.option("--stage", type=int, default=None,
              help="Stage of manifests/stages.yaml to run (default: the manifest's).")
@click.option("--gpus", default=None, help="Subset of GPUs, e.g. 0,1,2 or 0-3.")
@click.option("--devices", default=None,
              help="cpu:N, cuda, cuda:0-7 or auto (default: the pod config's).")
@click.option("--max-time", type=float, default=None,
              help="Stop gracefully (every worker checkpoints) after this many seconds.")
@click.option("--max-steps", type=click.IntRange(min=1), default=None,
              help="Each worker stops after this many steps (per worker start).")
@click.option("--detach", is_flag=True, help="Supervise in the background (logs/launcher.log).")
@click.option("--from-hub", "from_hub", default=None, metavar="URL",
              help="Rebuild this EMPTY pod directory from a hub (hf://owner/repo or "
                   "file://DIR): config, manifest, checkpoints; then launch.")
@click.option("--revision", default=None,
              help="With --from-hub: the hub revision to rebuild from (default: the newest).")
@trust_hub_config_option("--from-hub")
@click.option("--no-hub", is_flag=True,
              help="Train without the pod config's hub: no push, no pull (e.g. when another "
                   "pod took the run over). With --from-hub: rebuild without taking the run "
                   "over.")
@click.option("--no-canary", is_flag=True,
              help="Switch to a higher --stage without the canary (recorded in the events).")
@click.option("--ray", "ray_address", default=None, metavar="ADDRESS",
              help="Run the workers on the Ray cluster at ADDRESS (host:port), one actor per "
                   "GPU across its nodes (default: the pod config's ray: address, else "
                   "child processes on this machine).")
@click.option("--fault", "faults", multiple=True, hidden=True,
              help="Tests only: GPU:KIND@STEP fault injection on that worker's first start.")
@click.pass_context
def launch(ctx, stage, gpus, devices, max_time, max_steps, detach, from_hub, revision,
           trust_hub_config, no_hub, no_canary, ray_address, faults) -> None:
    """Validate everything, then start one worker per GPU and supervise them."""
    # A stop is never lost: SIGTERM/SIGINT are remembered from the first line.
    stop = EarlyStop(None)
    stop.install()
    # here, after EarlyStop: the launch's imports take seconds on a loaded machine
    from launcher.cli.launch_steps import LaunchOptions, launch_pod
    pod_dir = pod_dir_of(ctx)
    if revision and not from_hub:
        raise UserError("--revision goes with --from-hub (a resumed pod uses the revisions "
                        "its manifest records)")
    check_trust_flag(trust_hub_config, from_hub, "--from-hub",
                     "a pod's own fractus-pod.yaml is always taken as it is")
    sys.exit(launch_pod(LaunchOptions(
        pod_dir, stage, gpus, devices, max_time, max_steps, detach, from_hub, revision,
        trust_hub_config, no_hub, no_canary, ray_address, _parse_faults(faults),
        _retyped(ctx, pod_dir, "--no-hub")), stop))


def _retyped(ctx: click.Context, pod_dir: Path, *extra: str) -> str:
    """This launch's command line as it can be typed again, with `extra` options."""
    words = ["fractus-pod", "--pod-dir", str(pod_dir), "launch", *extra]
    for param in ctx.command.params:
        value = ctx.params.get(param.name)
        if not isinstance(param, click.Option) or value in (None, False, ()):
            continue        # (--pod-dir is not a value of the command: named above)
        for one in (value if param.multiple else (value,)):
            words += [param.opts[0]] if param.is_flag else [param.opts[0], str(one)]
    return shlex.join(words)
