"""`fractus-pod`: init, launch, status, stop, rollback, probe (sync and merge: launcher/cli/hub.py;
dashboard and plot: launcher/cli/view.py).

Every user mistake (bad file, bad option, busy pod) is one line on stderr and exit code 2,
with nothing started. `launch` exits 0 when the pod stopped or finished, 1 when it FAILED
or when the stage canary refused the switch.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import click

from launcher.cli.adopt import adopt
from launcher.cli.hub import POD_DIR_HELP, merge, pod_dir_of, pod_dir_option, sync
from launcher.cli.view import dashboard, plot
from launcher.errors import Refused, UserError


@click.group()
@click.option("--pod-dir", envvar="FRACTUS_POD_DIR", default=".", show_default=False,
              help=POD_DIR_HELP)
@click.pass_context
def cli(ctx: click.Context, pod_dir: str) -> None:
    """Run, guard and resume Fractus training on a pod (one worker per GPU)."""
    ctx.obj = {"pod_dir": pod_dir}


# ---- init -----------------------------------------------------------------------------
@cli.command()
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
    from launcher.config.podconfig import (
        init_pod,
        load_config,
        missing_shards,
        missing_shards_fix,
        write_demo_shards,
    )
    pod_dir = pod_dir_of(ctx)
    written, kept = init_pod(pod_dir, preset, force=force)
    for path in written:
        click.echo(f"wrote {path.relative_to(pod_dir)}")
    for path in kept:
        click.echo(f"kept {path.relative_to(pod_dir)} (yours, unchanged; delete it and rerun "
                   f"init --force for the default)")
    config = load_config(pod_dir)
    if config.demo_data and not no_data:
        for p in write_demo_shards(pod_dir, config):
            click.echo(f"wrote {Path(p).relative_to(pod_dir)} "
                       f"(synthetic, {config.demo_data['tokens']:,} tokens)")
    launch_cmd = f"fractus-pod --pod-dir {pod_dir} launch --stage 1"
    missing = missing_shards(pod_dir, config)
    click.echo(f"next: {missing_shards_fix(pod_dir, missing)}; then {launch_cmd}" if missing
               else f"next: {launch_cmd}")


# ---- launch ---------------------------------------------------------------------------
def _parse_faults(values: tuple[str, ...]) -> dict[int, str]:
    faults = {}
    for value in values:
        gpu, sep, spec = value.partition(":")
        if not sep or not gpu.isdigit() or not spec:
            raise UserError(f"--fault expects GPU:KIND@STEP (e.g. 1:nan@30), got {value!r}")
        faults[int(gpu)] = spec
    return faults


@cli.command()
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
           no_canary, ray_address, faults) -> None:
    """Validate everything, then start one worker per GPU and supervise them."""
    from launcher.pod.ckpt_index import CheckpointIndex
    from launcher.pod.events import EventLog
    from launcher.pod.lock import PodLock
    from launcher.supervise.prepare import (
        ensure_run_id,
        load_plan,
        never_resume_failed,
        on_the_hub,
        reconcile,
        record_baselines,
        recover_checkpoints,
        refuse_if_busy,
        validate,
    )
    from launcher.supervise.stage_switch import EarlyStop, LaunchStopped, canary_gate, current_stage
    from launcher.supervise.supervisor import Supervisor
    pod_dir = pod_dir_of(ctx)
    if revision and not from_hub:
        raise UserError("--revision goes with --from-hub (a resumed pod uses the revisions "
                        "its manifest records)")
    if from_hub:
        _rebuild(pod_dir, from_hub, revision, on_cluster=ray_address is not None)
    plan, manifest = load_plan(pod_dir, stage, devices, gpus, max_time, max_steps,
                               _parse_faults(faults))
    from launcher.config.ray_settings import RaySettings
    ray_settings = RaySettings.parse(plan.config.ray, ray_address)
    on_hub = on_the_hub(plan, manifest) if ray_settings is not None else set()
    if plan.config.hub:
        from launcher.hub.sync import store_for
        try:
            store_for(plan.config, pod_dir)    # a malformed hub: URL is refused up front
        except ValueError as exc:
            raise UserError(f"hub: {exc}") from None
    lock = PodLock(pod_dir)
    lock.acquire()
    events = None
    stop = EarlyStop(plan.deadline)     # `fractus-pod stop` works from here on
    stop.install()
    try:
        refuse_if_busy(plan)
        from launcher.supervise.tensorboard_events import EventsToTensorBoard
        events = EventLog(pod_dir, mirror=EventsToTensorBoard(pod_dir))
        index = CheckpointIndex(pod_dir)
        reconcile(plan, manifest, index, events)
        never_resume_failed(plan, manifest, index, events)
        recover_checkpoints(plan, manifest, index, events, on_hub)
        validate(plan, manifest, on_hub)
        supervisor = Supervisor(plan, manifest, index, events)
        try:
            supervisor.gate(lambda: canary_gate(plan, manifest, events, no_canary, stop))
        except LaunchStopped as exc:
            events.emit("launch_stopped", stage=current_stage(plan, manifest), reason=str(exc))
            click.echo(f"pod STOPPED: {exc}")
            sys.exit(0)
        record_baselines(plan, manifest, index, on_hub)
        ensure_run_id(manifest)
        if detach:
            events.mirror.close()          # its buffered lines would be written by both processes
            _daemonize(pod_dir)
            events.mirror = EventsToTensorBoard(pod_dir)
            lock.record_holder()
        if ray_settings is not None:       # after the fork: a Ray driver does not survive one
            supervisor.use_backend(_ray_backend(pod_dir, plan, ray_settings, events))
        stage = plan.stages[plan.stage]
        click.echo(f"pod {pod_dir}: stage {plan.stage} ({stage.name}), "
                   f"{len(plan.slots)} worker(s) on {plan.slots[0].device}"
                   + (f", for {plan.max_time:g}s" if plan.max_time else "")
                   + "; `fractus-pod status` to watch, `fractus-pod stop` to stop")
        supervisor.stop_reason = stop.signal       # a stop that came before supervision
        code = supervisor.run()
        ended = supervisor.pod
        click.echo(f"pod {ended.state.upper()} at stage {ended.stage}"
                   + (f": {ended.reason}" if ended.reason else ""))
    finally:
        if events is not None:
            events.mirror.close()
        lock.release()
    sys.exit(code)


def _ray_backend(pod_dir: Path, plan, settings, events):
    try:
        from launcher.supervise.ray_backend import RayBackend
    except ImportError:
        raise UserError("--ray needs Ray: pip install 'fractus-pod[ray]'") from None
    try:
        return RayBackend(pod_dir, plan.config, settings, events)
    except ConnectionError as exc:
        raise UserError(f"ray: cannot reach the cluster at {settings.address} "
                        f"({' '.join(str(exc).split())[:200]}); is `ray start` running "
                        f"there?") from None


def _rebuild(pod_dir: Path, url: str, revision: str | None, on_cluster: bool) -> None:
    """launch --from-hub: fill the empty pod directory from one pinned hub revision (for a
    Ray cluster, `on_cluster`, without the weights: each node pulls its GPU's)."""
    from launcher.pod.events import EventLog
    from launcher.hub.from_hub import rebuild_from_hub
    from launcher.hub import HubError
    try:
        rev, config, lease = rebuild_from_hub(pod_dir, url, revision, on_cluster)
    except HubError as exc:
        if exc.status == 404:              # no such repo or revision: the user's to fix
            raise UserError(f"--from-hub: {exc}") from None
        raise click.ClickException(f"--from-hub: {exc}") from None
    except ValueError as exc:
        raise UserError(f"--from-hub: {exc}") from None
    weights = ("on the hub: each Ray node pulls its GPU's" if on_cluster or config.ray
               else "pulled")
    EventLog(pod_dir).emit("rebuilt_from_hub", hub=url, revision=rev, pod_id=lease["pod_id"],
                           lease_epoch=lease["epoch"], previous_pod=lease["previous_pod"],
                           weights=weights)
    click.echo(f"rebuilt {pod_dir} from {url} at revision {rev[:12]}; this pod "
               f"({lease['pod_id']}) now writes the run (lease epoch {lease['epoch']})")


def _daemonize(pod_dir: Path) -> None:
    """Double fork; the parent prints the launcher's pid and exits 0."""
    read_fd, write_fd = os.pipe()
    if os.fork() > 0:
        os.close(write_fd)
        pid = os.read(read_fd, 32).decode().strip()
        click.echo(f"launcher running in the background (pid {pid}); "
                   f"`fractus-pod status`, `fractus-pod stop`; log: logs/launcher.log")
        os._exit(0)
    os.close(read_fd)
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    os.write(write_fd, str(os.getpid()).encode())
    os.close(write_fd)
    log = os.open(pod_dir / "logs" / "launcher.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)


# ---- status / stop / rollback ---------------------------------------------------------
@cli.command()
@pod_dir_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--watch", is_flag=True, help="Refresh every 2 s until Ctrl-C.")
@click.pass_context
def status(ctx, as_json: bool, watch: bool) -> None:
    """Per GPU: liveness, stage, progress, losses, speed, memory, checkpoint, verdict."""
    from launcher.config.podconfig import load_config
    from launcher.dashboard.status import collect, render
    pod_dir = pod_dir_of(ctx)
    config = load_config(pod_dir)
    if as_json:
        while True:
            click.echo(json.dumps(collect(pod_dir, config), default=str))
            if not watch:
                return
            time.sleep(2)
    from rich.console import Console
    console = Console(width=None if sys.stdout.isatty() else 200)
    if not watch:
        console.print(render(collect(pod_dir, config)))
        return
    from rich.live import Live
    try:
        with Live(render(collect(pod_dir, config)), console=console, refresh_per_second=1) as live:
            while True:
                time.sleep(2)
                live.update(render(collect(pod_dir, config)))
    except KeyboardInterrupt:
        pass


@cli.command()
@pod_dir_option
@click.option("--timeout", type=float, default=None,
              help="Seconds to wait for the launcher to finish (default: grace period + 30).")
@click.pass_context
def stop(ctx, timeout) -> None:
    """Graceful stop: every worker checkpoints, then the launcher exits."""
    from launcher.pod.lock import read_holder
    from launcher.config.podconfig import load_config
    from launcher.worker.process import running_workers
    pod_dir = pod_dir_of(ctx)
    config = load_config(pod_dir)
    holder = read_holder(pod_dir)
    if holder is None or not holder.get("pid"):
        orphans = running_workers(pod_dir)
        for pid in orphans.values():
            os.kill(pid, signal.SIGTERM)
        click.echo("no launcher is running" + (f"; sent SIGTERM to orphan worker(s) "
                                                f"{sorted(orphans.values())}" if orphans else ""))
        return
    os.kill(int(holder["pid"]), signal.SIGTERM)
    from launcher.pod.live_state import read_pod_state
    from launcher.hub.sync import read_sync_state
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
    click.echo(f"pod stopped (launcher pid {holder['pid']}); every worker checkpointed")


@cli.command()
@pod_dir_option
@click.option("--to-stage", type=click.IntRange(min=1), required=True)
@click.option("--gpu", "gpus", type=int, multiple=True,
              help="Restore this GPU's newest passed checkpoint (repeatable). Without it, "
                   "only the stage changes and every GPU keeps its progress.")
@click.pass_context
def rollback(ctx, to_stage: int, gpus: tuple[int, ...]) -> None:
    """The automatic rollback, by hand: restore GPU checkpoints and switch stage."""
    from launcher.supervise.manual import manual_rollback
    click.echo(manual_rollback(pod_dir_of(ctx), to_stage, list(gpus)))


@cli.command()
@pod_dir_option
@click.option("--gpu", type=int, default=None,
              help="Probe this GPU's newest checkpoint on its shard (default: GPU 0).")
@click.option("--checkpoint", default=None, help="Probe this checkpoint file instead.")
@click.option("--shard", default=None, help="Token shard (default: the GPU's).")
@click.option("--baseline-ar", type=float, default=None,
              help="Judge AR against this (default: the baseline recorded for the GPU's stage).")
@click.option("--record-baseline", is_flag=True,
              help="Record this AR as the baseline of the GPU's current stage.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--timeout", type=float, default=900, show_default=True, help="Seconds.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def probe(ctx, gpu, checkpoint, shard, baseline_ar, record_baseline, device, timeout,
          as_json) -> None:
    """The trusted-loss AR probe in a child process: AR, ARacc, cold TF (and a verdict)."""
    from launcher.supervise.manual import ProbeFailed, probe_pod
    try:
        report = probe_pod(pod_dir_of(ctx), gpu, checkpoint, shard, baseline_ar, record_baseline,
                           device, timeout)
    except ProbeFailed as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps(report))
    else:
        click.echo(f"{report['checkpoint']} on {report['shard']} (positions {report['start']:,}+, "
                   f"{report['rows']} rows): AR={report['ar']:.4f} ARacc={report['ar_acc']:.3f} "
                   f"cold_tf={report['cold_tf']:.4f}")
        if "verdict" in report:
            click.echo(f"{report['verdict']}: {report['reason']} "
                       f"(baseline {report['baseline_source']})")
        for line in (report.get("hint"), report.get("note")):
            if line:
                click.echo(line)
    if report.get("verdict") == "Failed":
        sys.exit(1)


# ---- hub, merge, dashboard, plot: launcher/cli/hub.py, launcher/cli/view.py ---------
cli.add_command(sync)
cli.add_command(merge)
cli.add_command(dashboard)
cli.add_command(plot)
cli.add_command(adopt)      # launcher/cli/adopt.py


def main(argv: list[str] | None = None) -> int:
    try:
        cli.main(args=argv, prog_name="fractus-pod", standalone_mode=False)
    except UserError as exc:
        click.echo(f"error: {exc}", err=True)
        return exc.exit_code
    except Refused as exc:               # printed as click printed its exceptions
        click.echo(f"Error: {exc}", err=True)
        return exc.exit_code
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        return 130
    except click.UsageError as exc:       # a bad option or argument: the user's to fix
        where = exc.ctx.command_path if exc.ctx is not None else "fractus-pod"
        click.echo(f"error: {exc.format_message().rstrip('.')} (see `{where} --help`)",
                   err=True)
        return 2
    except click.ClickException as exc:   # one prefix for every error, as for UserError
        click.echo(f"error: {exc.format_message()}", err=True)
        return exc.exit_code
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
