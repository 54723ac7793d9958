"""What every `fractus-pod` command shares: `--pod-dir` (on the group and after each
subcommand), the pod directory it resolves to, and the pod's logs/hub.log for hub retries."""

from __future__ import annotations

import logging
import shlex
from pathlib import Path

import click

from launcher.errors import UserError
from launcher.paths import HUB_LOG


POD_DIR_HELP = "Pod working directory (default: $FRACTUS_POD_DIR or the current directory)."


def pod_dir_of(ctx: click.Context) -> Path:
    """The --pod-dir, absolute; the pod's logs/hub.log then receives the hub's retries."""
    pod_dir = Path(ctx.obj["pod_dir"]).resolve()
    log_hub_retries(pod_dir)
    return pod_dir


def pod_command(pod_dir: Path, command: str) -> str:
    """`fractus-pod --pod-dir POD COMMAND` as a hint prints it: runnable from any folder."""
    return f"fractus-pod --pod-dir {shlex.quote(str(pod_dir))} {command}"


def log_hub_retries(pod_dir: Path) -> None:
    """Hub retries go to logs/hub.log, not the terminal (a failing push printed 6 to 47
    warnings); stderr gets one line per failed operation."""
    logger = logging.getLogger("launcher.hub")
    for old in [h for h in logger.handlers if getattr(h, "fractus_pod_log", False)]:
        logger.removeHandler(old)       # another pod's, or this one's from an earlier call
        old.close()
    to_file = _DelayedFileHandler(pod_dir / HUB_LOG)
    to_file.setLevel(logging.INFO)
    to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    to_stderr = logging.StreamHandler()         # the give-up line, on today's stderr
    to_stderr.setLevel(logging.WARNING)
    for handler in (to_file, to_stderr):
        handler.fractus_pod_log = True
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)


class _DelayedFileHandler(logging.FileHandler):
    """A FileHandler that makes logs/ only when it writes (a refusal writes nothing)."""

    def __init__(self, path: Path):
        super().__init__(path, delay=True)
        self._dir = path.parent

    def emit(self, record) -> None:
        if self.stream is None:
            self._dir.mkdir(parents=True, exist_ok=True)
        super().emit(record)


def pod_dir_option(command):
    """`--pod-dir` after the subcommand too (people type it there); overrides the group's."""
    def remember(ctx: click.Context, _param, value: str | None) -> None:
        if value is not None:
            ctx.obj["pod_dir"] = value
    return click.option("--pod-dir", default=None, expose_value=False, callback=remember,
                        help=POD_DIR_HELP)(command)


def trust_hub_config_option(source_flag: str):
    """`--trust-hub-config` of `launch --from-hub` and `sync pull --from`."""
    return click.option(
        "--trust-hub-config", is_flag=True,
        help=f"With {source_flag}: take the hub config's worker command, env, paths outside the "
             "pod and Ray cluster as they are (refused otherwise: they run on this machine).")


def check_trust_flag(trust_hub_config: bool, source: str | None, source_flag: str,
                     why_not: str) -> None:
    """--trust-hub-config only with the flag that names another hub (`why_not`: the reason)."""
    if trust_hub_config and not source:
        raise UserError(f"--trust-hub-config goes with {source_flag} ({why_not})")
