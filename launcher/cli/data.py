"""`fractus-pod data push --to URL`: the pod's shards into a dataset store, once, recorded
in fractus-pod.yaml's `data:` so `sync push` carries it and `launch --from-hub` fetches them."""

from __future__ import annotations

from pathlib import Path

import click

from launcher.cli.options import pod_dir_of, pod_dir_option
from launcher.config.devices import parse_devices
from launcher.config.podconfig import load_pod_config
from launcher.config.yamlfile import read_yaml, set_top_level_key
from launcher.hub import HubError
from launcher.hub.by_url import absolute_hub_url
from launcher.hub.data_source import push_shards
from launcher.hub.sync import retry_policy
from launcher.errors import UserError
from launcher.paths import CONFIG_NAME
from launcher.files import atomic_write_text


@click.group()
def data() -> None:
    """The pod's token shards on a hub (see `data:` in docs/LAUNCHER.md)."""


@data.command("push")
@pod_dir_option
@click.option("--to", "url", required=True, metavar="URL",
              help="The dataset store: hf://datasets/OWNER/REPO, or file://DIR.")
@click.pass_context
def push(ctx, url: str) -> None:
    """Upload the shards the store does not hold yet (compared by sha256; rerunning uploads
    nothing) in one revision, and write that revision into fractus-pod.yaml's data: (that
    key alone; the rest of the file stays as written)."""
    pod_dir = pod_dir_of(ctx)
    config = load_pod_config(pod_dir)
    paths = [rel for s in parse_devices(config.devices) for rel in config.shard_paths(s.gpu)]
    try:
        source, uploaded = push_shards(pod_dir, paths, absolute_hub_url(url, Path.cwd()),
                                       retry_policy(config))
    except HubError as exc:
        if exc.status == 404:
            raise UserError(f"data push: {exc}") from None
        raise click.ClickException(f"data push: {exc}") from None
    path = pod_dir / CONFIG_NAME
    settings = read_yaml(path, "pod config")
    if settings.get("data") != source.to_dict():
        # the one key edited in the text: the user's comments and layout stay as written
        atomic_write_text(path, set_top_level_key(path.read_text(encoding="utf-8"), "data",
                                                  source.to_dict(), str(path)))
    kept = len(paths) - len(uploaded)
    click.echo(f"data: {len(uploaded)} shard(s) uploaded, {kept} already there; "
               f"{source.url} at revision {source.revision[:12]} records them all; "
               f"{CONFIG_NAME} data: names it (`sync push` carries it to the pod's hub)")
