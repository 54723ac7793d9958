"""`fractus-pod dashboard` and `fractus-pod plot`: the pod's curves, read from its files
(launcher/dashboard/). Registered on the `fractus-pod` group by launcher/cli/main.py."""

from __future__ import annotations

import errno
from pathlib import Path

import click

from launcher.cli.options import pod_dir_of, pod_dir_option
from launcher.errors import UserError
from launcher.pod.events import read_events

DEFAULT_PORT = 8765


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
    # imported when run, not at startup: `fractus-pod --help` loads every command module
    from launcher.dashboard.server import make_server
    from launcher.config.podconfig import load_pod_config
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
    # imported when run, not at startup: `fractus-pod --help` loads every command module
    from launcher.dashboard.plot import plot_pod
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
    # imported when run, not at startup: `fractus-pod --help` loads every command module
    from launcher.config.podconfig import load_pod_config
    from launcher.dashboard.report import render_markdown, render_text
    from launcher.dashboard.goodput_files import goodput_report
    pod_dir = pod_dir_of(ctx)
    config = load_pod_config(pod_dir)
    render = render_markdown if markdown else render_text
    click.echo(render(str(pod_dir), goodput_report(pod_dir, config), read_events(pod_dir)),
               nl=not markdown)
