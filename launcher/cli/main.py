"""`fractus-pod`: init, status, stop, rollback, probe (launch: launcher/cli/launch.py; sync and
merge: launcher/cli/hub.py; dashboard, plot and report: launcher/cli/view.py; adopt: launcher/cli/adopt.py).

Every user mistake (bad file, bad option, busy pod) is one line on stderr and exit code 2,
with nothing started. `launch` exits 0 when the pod stopped or finished, 1 when it FAILED
or when the stage canary refused the switch.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import termios
import time
from contextlib import contextmanager
from pathlib import Path

import click

from fractus import __version__
from launcher.cli.adopt import adopt
from launcher.cli.data import data
from launcher.cli.alert import alert
from launcher.cli.launch import launch
from launcher.cli.hub import merge, sync
from launcher.cli.options import POD_DIR_HELP, pod_dir_of, pod_dir_option
from launcher.cli.view import dashboard, plot
from launcher.cli.view import report as report_command
from launcher.errors import Refused, UserError
from launcher.pod.events import read_events
from launcher.pod.lock import read_holder
from launcher.pod.live_state import read_pod_state
from launcher.pod.live_state import write_stop_request


@click.group()
@click.version_option(__version__, prog_name="fractus-pod", message="%(prog)s %(version)s")
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
    # imported when run, not at startup: `fractus-pod --help` loads every command module
    from launcher.pod.setup_init import create_pod, missing_shards, missing_shards_fix
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


# ---- status / stop / rollback ---------------------------------------------------------
@cli.command()
@pod_dir_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--watch", is_flag=True, help="Refresh every 2 s until Ctrl-C.")
@click.option("--wide", is_flag=True,
              help="Every column in full, however wide (default: the columns that fit the "
                   "terminal, one line per GPU).")
@click.pass_context
def status(ctx, as_json: bool, watch: bool, wide: bool) -> None:
    """Per GPU: liveness, stage, progress, losses, speed, memory, checkpoint, verdict."""
    # imported when run, not at startup: `fractus-pod --help` loads every command module
    from launcher.config.podconfig import load_pod_config
    from launcher.dashboard.goodput_files import LedgerSource, goodput_report
    from launcher.dashboard.status import StatusView, collect
    pod_dir = pod_dir_of(ctx)
    config = load_pod_config(pod_dir)
    ledger = LedgerSource(pod_dir)      # --watch: each refresh reads only appended lines

    def report() -> dict:
        return collect(pod_dir, config, goodput=goodput_report(pod_dir, config, ledger))
    if as_json:
        while True:
            click.echo(json.dumps(report(), default=str))
            if not watch:
                return
            time.sleep(2)
    from rich.console import Console
    console = Console(width=_output_width())

    def view() -> StatusView:
        shown = StatusView(report(), wide=wide)
        if wide:       # past the terminal's edge, as `kubectl get -o wide` does
            console.width = max(console.width, shown.natural_width())
        return shown
    if not watch:
        console.print(view())
        return
    from rich.live import Live
    try:
        with _keys_not_echoed(), Live(view(), console=console, refresh_per_second=1) as live:
            while True:
                time.sleep(2)
                live.update(view())
    except KeyboardInterrupt:
        pass


def _output_width() -> int | None:
    """The width `status` fits: $COLUMNS when it is set (a pipe too), else the terminal's
    (None: rich asks it), else 200 (a pipe or a file)."""
    columns = os.environ.get("COLUMNS", "").strip()
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    return None if sys.stdout.isatty() else 200


@contextmanager
def _keys_not_echoed():
    """`status --watch` on a terminal: the keys typed (Ctrl-C's `^C`) are not echoed into
    the live frame; an echo that wrapped the frame's last line put the final redraw a line
    low, under a copy of its first line. The terminal's settings come back on the way out."""
    try:
        fd = sys.stdin.fileno()
        saved = termios.tcgetattr(fd)
    except (OSError, ValueError, termios.error):      # not a terminal
        yield
        return
    quiet = list(saved)
    quiet[3] &= ~(termios.ECHO | termios.ECHOCTL)      # the local modes
    termios.tcsetattr(fd, termios.TCSANOW, quiet)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSANOW, saved)


@cli.command()
@pod_dir_option
@click.option("--timeout", type=float, default=None,
              help="Seconds to wait for the launcher to finish (default: grace period + 30).")
@click.pass_context
def stop(ctx, timeout) -> None:
    """Graceful stop: every worker checkpoints, then the launcher exits."""
    # imported when run, not at startup: `fractus-pod --help` loads every command module
    from launcher.config.podconfig import load_pod_config
    from launcher.worker.process import running_workers
    pod_dir = pod_dir_of(ctx)
    config = load_pod_config(pod_dir)
    holder = read_holder(pod_dir)
    if holder is None or not holder.get("pid"):
        # A launcher may be starting and not hold the pod yet: it takes this request when it
        # does. Then look again: one that took the pod meanwhile (after its look at the
        # request) holds it now and gets the signal (launcher/pod/live_state.py).
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
    # launcher.hub (its package) only once a launcher is signalled, not at CLI startup
    from launcher.hub.sync_state import read_sync_state
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
    """Whether the launcher that held the pod (since `holder['since']`) started a worker."""
    since = holder.get("since") or 0
    return any(e.get("event") in ("worker_start", "worker_placed")
               and isinstance(e.get("ts"), (int, float)) and e["ts"] >= since
               for e in read_events(pod_dir))


@cli.command()
@pod_dir_option
@click.option("--to-stage", type=click.IntRange(min=1), required=True,
              help="The stage to go back to (a stage of manifests/stages.yaml below the "
                   "pod's; the next launch runs it).")
@click.option("--gpu", "gpus", type=int, multiple=True,
              help="Restore this GPU's newest passed checkpoint (repeatable). Without it, "
                   "only the stage changes and every GPU keeps its progress.")
@click.pass_context
def rollback(ctx, to_stage: int, gpus: tuple[int, ...]) -> None:
    """The automatic rollback, by hand: restore GPU checkpoints and switch stage."""
    # imported when run, not at startup: `fractus-pod --help` loads every command module
    from launcher.cli.rollback_probe import manual_rollback
    click.echo(manual_rollback(pod_dir_of(ctx), to_stage, list(gpus)))


@cli.command()
@pod_dir_option
@click.option("--gpu", type=int, default=None,
              help="Probe this GPU's newest checkpoint on its shard (default: GPU 0).")
@click.option("--checkpoint", default=None, help="Probe this checkpoint file instead.")
@click.option("--shard", default=None, help="Token shard (default: the GPU's).")
@click.option("--head", type=click.IntRange(min=0), default=None,
              help="Shard position the probe windows start at (default: the GPU's manifest "
                   "head; for --checkpoint, the head it records, else the manifest head of "
                   "the GPU training on --shard, else 0).")
@click.option("--baseline-ar", type=float, default=None,
              help="Judge AR against this (default: the baseline recorded for the GPU's stage).")
@click.option("--record-baseline", is_flag=True,
              help="Record this AR as the baseline of the GPU's current stage.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--timeout", type=float, default=900, show_default=True, help="Seconds.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def probe(ctx, gpu, checkpoint, shard, head, baseline_ar, record_baseline, device, timeout,
          as_json) -> None:
    """The trusted-loss AR probe in a child process: AR, ARacc, cold TF (and a verdict)."""
    # imported when run, not at startup: `fractus-pod --help` loads every command module
    from launcher.cli.rollback_probe import ProbeFailed, probe_pod
    try:
        report = probe_pod(pod_dir_of(ctx), gpu, checkpoint, shard, baseline_ar, record_baseline,
                           device, timeout, head)
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
        for line in (report.get("filled"), report.get("head_note"), report.get("hint"),
                     report.get("note")):
            if line:
                click.echo(line)
    if report.get("verdict") == "Failed":
        sys.exit(1)


# ---- hub, merge, dashboard, plot: launcher/cli/hub.py, launcher/cli/view.py ---------
cli.add_command(sync)
cli.add_command(merge)
cli.add_command(dashboard)
cli.add_command(plot)
cli.add_command(report_command)     # launcher/cli/view.py
cli.add_command(adopt)      # launcher/cli/adopt.py
cli.add_command(launch)     # launcher/cli/launch.py
cli.add_command(data)       # launcher/cli/data.py
cli.add_command(alert)      # launcher/cli/alert.py


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
