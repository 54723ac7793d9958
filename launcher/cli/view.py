"""`fractus-pod status`, `dashboard`, `plot` and `report`: the pod read from its files
(launcher/dashboard/)."""

from __future__ import annotations

import errno
import json
import os
import sys
import termios
import time
from contextlib import contextmanager
from pathlib import Path

import click
from rich.console import Console
from rich.live import Live

from launcher.cli.options import pod_dir_of, pod_dir_option
from launcher.config.podconfig import load_pod_config
from launcher.dashboard.goodput_files import LedgerSource, goodput_report
from launcher.dashboard.plot import plot_pod
from launcher.dashboard.report import render_markdown, render_text
from launcher.dashboard.server import make_server
from launcher.dashboard.status import StatusView, collect
from launcher.errors import UserError
from launcher.pod.events import read_events

DEFAULT_PORT = 8765


@click.command()
@pod_dir_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--watch", is_flag=True, help="Refresh every 2 s until Ctrl-C.")
@click.option("--wide", is_flag=True,
              help="Every column in full, however wide (default: the columns that fit the "
                   "terminal, one line per GPU).")
@click.pass_context
def status(ctx, as_json: bool, watch: bool, wide: bool) -> None:
    """Per GPU: liveness, stage, progress, losses, speed, memory, checkpoint, verdict."""
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
    console = Console(width=_output_width())

    def view() -> StatusView:
        shown = StatusView(report(), wide=wide)
        if wide:       # past the terminal's edge, as `kubectl get -o wide` does
            console.width = max(console.width, shown.natural_width())
        return shown
    if not watch:
        console.print(view())
        return
    try:
        with _keys_not_echoed(), Live(view(), console=console, refresh_per_second=1) as live:
            while True:
                time.sleep(2)
                live.update(view())
    except KeyboardInterrupt:
        pass


def _output_width() -> int | None:
    """$COLUMNS when set, else the terminal's (None: rich asks it), else 200 (a pipe)."""
    columns = os.environ.get("COLUMNS", "").strip()
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    return None if sys.stdout.isatty() else 200


@contextmanager
def _keys_not_echoed():
    """Typed keys (Ctrl-C's `^C`) not echoed into the live frame: an echo that wrapped its
    last line put the final redraw a line low."""
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


@click.command()
@pod_dir_option
@click.option("--port", type=click.IntRange(0, 65535), default=DEFAULT_PORT, show_default=True,
              help="TCP port (0: any free one).")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; the default keeps the page on this machine "
                   "(reach it through an SSH tunnel).")
@click.pass_context
def dashboard(ctx, port: int, host: str) -> None:
    """A live page of the pod: per-GPU curves, markers, the status table (read-only)."""
    pod_dir = pod_dir_of(ctx)
    config = load_pod_config(pod_dir)
    try:
        server = make_server(pod_dir, config, host, port)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise UserError(f"--port {port} is in use on {host}; choose another with "
                            f"--port (0 picks a free one)") from None
        raise UserError(f"--host {host!r}: {exc.strerror or exc}") from None
    bound_host, bound_port = server.server_address[:2]
    click.echo(f"dashboard of {pod_dir} on http://{bound_host}:{bound_port}/ (Ctrl-C stops it)")
    try:
        server.serve_forever(poll_interval=1.0)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


@click.command()
@pod_dir_option
@click.option("--out", default="run.png", show_default=True, help="PNG file to write.")
@click.option("--width", type=click.IntRange(320, 8000), default=1600, show_default=True,
              help="Pixels.")
@click.option("--height", type=click.IntRange(240, 8000), default=1200, show_default=True,
              help="Pixels.")
@click.option("--x", "x_mode", type=click.Choice(["tokens", "time"]), default="tokens",
              show_default=True,
              help="x axis: the tokens the pod trained (idle time takes no width; run "
                   "starts marked), or the clock with idle gaps cut (marked with their "
                   "length).")
@click.pass_context
def plot(ctx, out: str, width: int, height: int, x_mode: str) -> None:
    """The dashboard's curves as one PNG (ema_tf, lb, tok/s per GPU, stages, markers)."""
    pod_dir = pod_dir_of(ctx)
    target = Path(out) if Path(out).is_absolute() else Path.cwd() / out
    if not target.parent.is_dir():
        raise UserError(f"--out {out}: folder {target.parent} does not exist; create it or "
                        f"choose another --out")
    lines = plot_pod(pod_dir, target, width, height, x_mode)
    if not lines:
        raise UserError(f"no metrics lines under {pod_dir}/logs yet: nothing to plot "
                        f"(check --pod-dir)")
    click.echo(f"wrote {out} ({width}x{height}, {lines:,} metrics lines)")


@click.command()
@pod_dir_option
@click.option("--markdown", is_flag=True, help="Markdown (tables), for notes.")
@click.pass_context
def report(ctx, markdown: bool) -> None:
    """A run's summary: goodput, GPU-hours (and money), time lost by cause, incidents."""
    pod_dir = pod_dir_of(ctx)
    config = load_pod_config(pod_dir)
    render = render_markdown if markdown else render_text
    click.echo(render(str(pod_dir), goodput_report(pod_dir, config), read_events(pod_dir)),
               nl=not markdown)
