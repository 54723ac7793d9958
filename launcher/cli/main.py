"""`fractus-pod`: the command group; a command's module is imported only when it runs or
shows its help. Every user mistake is one line on stderr, exit 2, nothing started; `launch`
exits 0 when the pod stopped or finished, 1 when it FAILED or the canary refused.
"""

from __future__ import annotations

import importlib
import sys

import click

from fractus import __version__
from launcher.cli.options import POD_DIR_HELP
from launcher.errors import Refused, UserError

# command -> (its module, its short help for `--help` without the import; test_cli_lazy.py
# holds the two equal)
COMMANDS = {
    "adopt": ("launcher.cli.adopt", "Take over this run directory unchanged: find its "
              "manifests, checkpoints and shards, hash them, write fractus-pod.yaml naming "
              "them, keep the originals as the adoption baseline."),
    "alert": ("launcher.cli.alert", "The pod's alert webhooks (alerts: in fractus-pod.yaml)."),
    "dashboard": ("launcher.cli.view", "A live page of the pod: per-GPU curves, markers, the "
                  "status table (read-only)."),
    "data": ("launcher.cli.data", "The pod's token shards on a hub (see `data:` in "
             "docs/LAUNCHER.md)."),
    "init": ("launcher.cli.init_stop", "Write fractus-pod.yaml (and, for tiny-cpu, synthetic "
             "shards under data/)."),
    "launch": ("launcher.cli.launch", "Validate everything, then start one worker per GPU and "
               "supervise them."),
    "merge": ("launcher.cli.hub", "Mean of the floating tensors of every GPU's checkpoint "
              "(streamed)."),
    "plot": ("launcher.cli.view", "The dashboard's curves as one PNG (ema_tf, lb, tok/s per "
             "GPU, stages, markers)."),
    "probe": ("launcher.cli.rollback_probe", "The trusted-loss AR probe in a child process: AR, "
              "ARacc, cold TF (and a verdict)."),
    "report": ("launcher.cli.view", "A run's summary: goodput, GPU-hours (and money), time lost "
               "by cause, incidents."),
    "rollback": ("launcher.cli.rollback_probe", "The automatic rollback, by hand: restore GPU "
                 "checkpoints and switch stage."),
    "status": ("launcher.cli.view", "Per GPU: liveness, stage, progress, losses, speed, memory, "
               "checkpoint, verdict."),
    "stop": ("launcher.cli.init_stop", "Graceful stop: every worker checkpoints, then the "
             "launcher exits."),
    "sync": ("launcher.cli.hub", "Push to / pull from the pod's hub store (the `hub:` of "
             "fractus-pod.yaml)."),
}


class LazyGroup(click.Group):

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        return getattr(importlib.import_module(COMMANDS[name][0]), name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        limit = formatter.width - 6 - max(map(len, COMMANDS))
        with formatter.section("Commands"):
            formatter.write_dl([(name, click.Command(name, help=text).get_short_help_str(limit))
                                for name, (_, text) in sorted(COMMANDS.items())])


@click.group(cls=LazyGroup)
@click.version_option(__version__, prog_name="fractus-pod", message="%(prog)s %(version)s")
@click.option("--pod-dir", envvar="FRACTUS_POD_DIR", default=".", show_default=False,
              help=POD_DIR_HELP)
@click.pass_context
def cli(ctx: click.Context, pod_dir: str) -> None:
    """Run, guard and resume Fractus training on a pod (one worker per GPU)."""
    ctx.obj = {"pod_dir": pod_dir}


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
