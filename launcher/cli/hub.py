"""`fractus-pod sync push|pull|history` and `fractus-pod merge`: thin wrappers, the work
lives in launcher.hub, launcher.hub.sync(_push), launcher.hub.pull and launcher.hub.merge."""

from __future__ import annotations

import functools
from contextlib import nullcontext
from pathlib import Path

import click

from launcher.cli.options import (check_trust_flag, pod_dir_of, pod_dir_option,
                                  trust_hub_config_option)
from launcher.config.podconfig import load_pod_config
from launcher.errors import UserError
from launcher.hub import HubError, open_store
from launcher.hub.merge import merge_checkpoints
from launcher.hub.pull import pull_into_pod
from launcher.hub.retention import history_marks
from launcher.hub.sync import store_for
from launcher.hub.sync_push import push_now
from launcher.pod.ckpt_trust import check_entry
from launcher.pod.manifest import read_manifest, resolve_in_pod
from launcher.paths import MERGED_PATH


@click.group()
@pod_dir_option
def sync() -> None:
    """Push to / pull from the pod's hub store (the `hub:` of fractus-pod.yaml)."""


def _hub_errors(fn):
    """Hub failures in one line (never with the token): bad URL/path or 404 exit 2, else 1."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except HubError as exc:
            if exc.status == 404:          # no such store, revision or file: as launch does
                raise UserError(str(exc)) from None
            raise click.ClickException(str(exc)) from None
        except ValueError as exc:
            raise UserError(str(exc)) from None
    return wrapper


def _store(pod_dir: Path):
    config = load_pod_config(pod_dir)
    if not config.hub:
        raise UserError("no hub configured: set `hub:` in fractus-pod.yaml "
                        "(file://DIR or hf://owner/repo)")
    return open_store(config.hub, pod_dir)


@sync.command("history")
@pod_dir_option
@click.pass_context
@_hub_errors
def sync_history(ctx) -> None:
    """Revisions of the hub store, newest first."""
    pod_dir = pod_dir_of(ctx)
    store = _store(pod_dir)
    entries = store.history()
    if not entries:
        click.echo(f"no revisions in {store.url} yet (`fractus-pod sync push`, or a running "
                   f"launcher pushes every sync interval)")
    config = load_pod_config(pod_dir)
    settings = config.retention_settings()
    marks: dict[str, str] = {}
    if settings is not None and entries:   # without a policy nothing is ever deleted
        marks, storage = history_marks(store, settings, pod_dir, config.manifest)
        click.echo(storage)
    for entry in entries:
        mark = f"  [{marks[entry.revision]}]" if entry.revision in marks else ""
        click.echo(f"{entry.revision[:12]}  {entry.timestamp.isoformat(timespec='seconds')}  "
                   f"{entry.message}{mark}")


@sync.command("push")
@pod_dir_option
@click.option("--message", "-m", default="fractus-pod sync push", show_default=True,
              help="The revision's message (shown by `sync history`).")
@click.pass_context
@_hub_errors
def sync_push(ctx, message: str) -> None:
    """Push every GPU's newest passed checkpoint and the manifest as one revision."""
    pod_dir = pod_dir_of(ctx)
    _store(pod_dir)                        # refuses a pod without a hub
    revision, noted, skipped = push_now(pod_dir, load_pod_config(pod_dir), message)
    click.echo(f"skipped: revision {revision} already holds these checkpoints and this "
               f"manifest" if skipped
               else f"pushed revision {revision}")
    click.echo(f"manifest: hub_revision recorded for GPU(s) {noted}" if noted else
               "manifest: hub_revision unchanged (a running launcher records it, or the "
               "manifest names newer checkpoints than the ones that passed)")


@sync.command("pull")
@pod_dir_option
@click.option("--revision", default=None, help="Revision to pull (default: the newest).")
@click.option("--from", "from_url", default=None, metavar="URL",
              help="The hub to pull from (hf://owner/repo or file://DIR); default: the pod's "
                   "`hub:`. Into a new folder, this is all it needs.")
@click.option("--force", is_flag=True,
              help="Replace the manifest or a checkpoint it names with other bytes.")
@trust_hub_config_option("--from")
@click.argument("paths", nargs=-1)
@click.pass_context
@_hub_errors
def sync_pull(ctx, revision, from_url, force, trust_hub_config, paths) -> None:
    """Pull files (default: all) from the hub store, verified by sha256."""
    check_trust_flag(trust_hub_config, from_url, "--from",
                     "a pull from the pod's own `hub:` takes its config as it is")
    url, rev, pulled = pull_into_pod(pod_dir_of(ctx), from_url, revision, list(paths), force,
                                     trust_hub_config)
    for rel in sorted(pulled):
        click.echo(f"pulled {rel}")
    click.echo(f"from {url} at revision {rev[:12]}")


@click.command()
@pod_dir_option
@click.option("--out", default=MERGED_PATH, show_default=True)
@click.pass_context
def merge(ctx, out: str) -> None:
    """Mean of the floating tensors of every GPU's checkpoint (streamed). A checkpoint not on
    this machine (a Ray pod's are on its nodes) is read from the hub revision the manifest
    records, one at a time. The launch's trust rules hold: each file inside the pod, the
    GPU's own (GPU, shard, run, token), every tensor finite."""
    pod_dir = pod_dir_of(ctx)
    config = load_pod_config(pod_dir)
    manifest = read_manifest(pod_dir / config.manifest)
    paths, on_hub, missing, gpu_of = [], {}, [], {}
    for gpu, entry in sorted(manifest.entries.items()):
        if not entry.checkpoint:
            continue
        try:
            local = resolve_in_pod(entry.checkpoint, pod_dir)
        except ValueError as exc:
            raise UserError(f"merge: gpu_{gpu} checkpoint {exc}; checkpoints must live inside "
                            f"the pod (copy the file in and name it relative to the pod)") from None
        if local.is_file():
            paths.append(str(local))
        elif entry.hub_revision and entry.checkpoint_sha256 and config.hub:
            hub_path = config.checkpoint_path(gpu)
            paths.append(hub_path)
            on_hub[hub_path] = entry
        else:
            missing.append(f"gpu_{gpu} ({entry.checkpoint})")
            continue
        gpu_of[paths[-1]] = gpu
    if missing:
        raise UserError(f"merge: not on this machine and no hub revision recorded for "
                        f"{', '.join(missing)}; run it where they are, or `fractus-pod sync "
                        f"pull` them")
    if not paths:
        raise UserError("the manifest names no checkpoint to merge")
    store = None
    if on_hub:
        try:
            store = store_for(config, pod_dir)
        except ValueError as exc:
            raise UserError(f"hub: {exc}") from None

    def checkpoint(path: str):
        if path not in on_hub:
            return nullcontext(path)
        entry = on_hub[path]
        return store.fetched(path, entry.hub_revision, entry.checkpoint_sha256)

    def its_own(path: str, local: Path) -> None:
        check_entry(manifest, pod_dir, gpu_of[path], config.shard_path, path=local)

    try:
        merge_checkpoints(paths, pod_dir / out, fetch=checkpoint, verify=its_own)
    except (ValueError, FileNotFoundError) as exc:
        raise UserError(f"merge: {exc}") from None
    except HubError as exc:
        raise click.ClickException(f"merge: {exc}") from None
    click.echo(f"merged {len(paths)} checkpoints -> {out}"
               + (f" ({len(on_hub)} read from the hub, one at a time)" if on_hub else ""))
