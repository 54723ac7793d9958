"""`fractus-pod init` and `fractus-pod stop`: a pod directory's first files
(launcher/pod/setup_init.py), and the graceful stop of the launcher that holds it."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import click

from launcher.cli.options import pod_dir_of, pod_dir_option
from launcher.config.podconfig import load_pod_config
from launcher.hub.sync_state import read_sync_state
from launcher.pod.events import read_events
from launcher.pod.live_state import read_pod_state, write_stop_request
from launcher.pod.lock import read_holder
from launcher.pod.setup_init import create_pod, missing_shards, missing_shards_fix
from launcher.worker.process import running_workers


@click.command()
@pod_dir_option
@click.option("--preset", default="tiny-cpu", show_default=True,
              help="tiny-cpu (CPU demo: 2 tiny workers, synthetic shards, local hub) or "
                   "1b-8gpu (the production run).")
@click.option("--force", is_flag=True,
              help="Overwrite an existing fractus-pod.yaml (your stage and criteria files "
                   "under manifests/ are always kept).")
@click.option("--no-data", is_flag=True, help="Do not write the preset's synthetic shards.")
@click.pass_context
def init(ctx, preset: str, force: bool, no_data: bool) -> None:
    """Write fractus-pod.yaml (and, for tiny-cpu, synthetic shards under data/)."""
    pod_dir = pod_dir_of(ctx)
    pod = create_pod(pod_dir, preset, force=force, demo_shards=not no_data)  # all or nothing
    config, numbers = pod.config, pod.stages
    for path in pod.written:
        click.echo(f"wrote {path.relative_to(pod_dir)}")
    for path in pod.kept:
        click.echo(f"kept {path.relative_to(pod_dir)} (yours, unchanged; delete it and rerun "
                   f"init --force for the default)")
    for path in pod.shards:
        click.echo(f"wrote {path.relative_to(pod_dir)} "
                   f"(synthetic, {config.demo_data['tokens']:,} tokens)")
    launch_cmd = (f"fractus-pod --pod-dir {pod_dir} launch --stage N (N: a stage of "
                  f"{config.stages}, {numbers[0]} to {numbers[-1]}; a new pod starts at any, "
                  f"a later switch up runs the canary)")
    missing = missing_shards(pod_dir, config)
    click.echo(f"next: {missing_shards_fix(pod_dir, missing)}; then {launch_cmd}" if missing
               else f"next: {launch_cmd}")


@click.command()
@pod_dir_option
@click.option("--timeout", type=float, default=None,
              help="Seconds to wait for the launcher to finish (default: grace period + 30).")
@click.pass_context
def stop(ctx, timeout) -> None:
    """Graceful stop: every worker checkpoints, then the launcher exits."""
    pod_dir = pod_dir_of(ctx)
    config = load_pod_config(pod_dir)
    holder = read_holder(pod_dir)
    if holder is None or not holder.get("pid"):
        # A starting launcher takes this request when it locks the pod; one that took the
        # pod meanwhile (after its look at the request) gets the signal below.
        write_stop_request(pod_dir)
        holder = read_holder(pod_dir)
    if holder is None or not holder.get("pid"):
        orphans = running_workers(pod_dir)
        for pid in orphans.values():
            os.kill(pid, signal.SIGTERM)
        click.echo("no launcher is running" + (f"; sent SIGTERM to orphan worker(s) "
                                                f"{sorted(orphans.values())}" if orphans else ""))
        return
    os.kill(int(holder["pid"]), signal.SIGTERM)
    deadline = time.monotonic() + (timeout if timeout is not None else config.stop_grace_s + 30)
    while read_holder(pod_dir) is not None:
        if timeout is None and (read_sync_state(pod_dir).get("in_flight") or
                                (read_pod_state(pod_dir) or {}).get("pod_state") == "judging"):
            # The final probes (each bounded by probe.timeout_s) or the final hub push run.
            deadline = max(deadline, time.monotonic() + 30)
        if time.monotonic() > deadline:
            raise click.ClickException(f"launcher pid {holder['pid']} still running after "
                                       f"the timeout; check logs/launcher.log")
        time.sleep(0.2)
    click.echo(f"pod stopped (launcher pid {holder['pid']}); "
               + ("every worker checkpointed" if _workers_started(pod_dir, holder)
                  else "no worker had started: nothing to checkpoint"))


def _workers_started(pod_dir: Path, holder: dict) -> bool:
    """Whether the launcher that held the pod since `holder['since']` started a worker."""
    since = holder.get("since") or 0
    return any(e.get("event") in ("worker_start", "worker_placed")
               and isinstance(e.get("ts"), (int, float)) and e["ts"] >= since
               for e in read_events(pod_dir))
