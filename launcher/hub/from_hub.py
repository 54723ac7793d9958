"""`fractus-pod launch --from-hub URL [--revision R]`: rebuild a pod from one pinned hub
revision alone (a rented host can vanish); a refused rebuild leaves its directory empty and
the run's lease where it was. docs/LAUNCHER.md "Hub"."""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from launcher.hub.integrity import IntegrityError
from launcher.hub.by_url import absolute_hub_url
from launcher.pod.events import EventLog
from launcher.pod.manifest import write_manifest
from launcher.files import atomic_write_text
from launcher.config.devices import parse_devices
from launcher.config.podconfig import PodConfig
from launcher.paths import CONFIG_NAME
from launcher.errors import UserError
from launcher.config.yamlfile import read_yaml, set_top_level_key
from launcher.hub import open_store
from launcher.pod.manifest import read_manifest
from launcher.config.podconfig import load_pod_config
from launcher.pod.setup_init import write_demo_shards
from launcher.config.stages import load_stages
from launcher.hub.config_trust import refusal, untrusted_config, untrusted_stages
from launcher.hub.retention import refuse_deleted
from launcher.hub.round_files import fetched_rounds
from launcher.hub.lease import take_over


MAX_WALK_BACK = 20      # revisions looked at for the newest consistent one
# The first line keep_hub writes: "# rebuilt from URL ..." or "# pulled from URL ..."
PROVENANCE = ("# rebuilt from ", "# pulled from ")


@dataclass(frozen=True)
class Rebuilt:
    """A rebuilt pod not yet writing the run: the launch checks, then `take_run` or `undo`."""

    pod_dir: Path
    url: str                # absolute: the store as this pod names it
    revision: str
    config: PodConfig
    created: bool           # the directory did not exist before the rebuild

    def take_run(self) -> dict:
        """Become the run's one writer (the old pod is refused at its next push); the lease."""
        return take_over(open_store(self.url, self.pod_dir), self.pod_dir)

    def undo(self) -> None:
        leave_empty(self.pod_dir, self.created)


def rebuild_from_hub(pod_dir: Path, url: str, revision: str | None,
                     on_cluster: bool = False,
                     trust_config: bool = False,
                     ray_address: str | None = None) -> Rebuilt:
    """Fill an EMPTY pod directory from one hub revision, checkpoints verified against the
    hub index AND the manifest, the merge rounds' state as round_files.py checks it; nothing
    written to the hub. On a Ray cluster (`on_cluster` or `ray:`) the weights stay on the
    hub (each node pulls its own). An untrusted config (config_trust.py) is refused unless
    `trust_config`; `ray_address` (launch --ray) replaces the config's. A relative
    file:// `url` is relative to the cwd."""
    if pod_dir.exists() and (not pod_dir.is_dir() or any(pod_dir.iterdir())):
        raise UserError(f"--from-hub rebuilds a pod in an EMPTY directory; {pod_dir} is not "
                        f"empty (use a new --pod-dir, or plain `launch` to resume this pod)")
    url = absolute_hub_url(url, Path.cwd())
    created = not pod_dir.exists()
    pod_dir.mkdir(parents=True, exist_ok=True)
    try:
        rev, config = _rebuild(pod_dir, url, revision, on_cluster, trust_config, ray_address)
    except BaseException:
        leave_empty(pod_dir, created)
        raise
    return Rebuilt(pod_dir, url, rev, config, created)


def leave_empty(pod_dir: Path, created: bool) -> None:
    """The directory as empty as it was before the rebuild: gone if it was made for it."""
    empty_dir(pod_dir)
    if created:
        pod_dir.rmdir()


def empty_dir(pod_dir: Path) -> None:
    for child in list(pod_dir.iterdir()):
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


def keep_hub(pod_dir: Path, url: str, note: str) -> None:
    """Point the pulled config's `hub:` at `url` (a relative one means nothing here), keeping
    its comments and key order, under one provenance line `note` (replaced, not stacked)."""
    path = pod_dir / CONFIG_NAME
    data = read_yaml(path, "the hub's pod config") or {}
    if isinstance(data, dict) and data.get("hub") != url:
        text = set_top_level_key(path.read_text(encoding="utf-8"), "hub", url, str(path))
        if text.startswith(PROVENANCE):
            text = text.split("\n", 1)[1] if "\n" in text else ""
        atomic_write_text(path, f"# {note}\n" + text)


def _rebuild(pod_dir: Path, url: str, revision: str | None, on_cluster: bool,
             trust_config: bool, ray_address: str | None) -> tuple[str, PodConfig]:
    store = open_store(url, pod_dir)
    if revision is not None:
        rev = store.resolve(revision)
        return rev, _rebuild_at(pod_dir, url, store, rev, on_cluster, trust_config,
                                ray_address)
    # The newest revision, unless it is mid-push: on a Ray pod a node commits its checkpoint
    # and the launcher then commits the manifest naming it; a launcher that died between
    # the two leaves a head whose manifest names the previous bytes. The newest revision
    # before it whose manifest names the bytes it holds is the run's last consistent state.
    newest = store.resolve(None)
    skipped: list[MidPush] = []
    for entry in store.history()[:MAX_WALK_BACK]:
        try:
            config = _rebuild_at(pod_dir, url, store, entry.revision, on_cluster, trust_config,
                                 ray_address)
        except MidPush as exc:
            skipped.append(exc)
            empty_dir(pod_dir)
            continue
        if skipped:
            print(f"fractus-pod: the hub's newest revision {newest[:12]} is mid-push "
                  f"({skipped[0].differing}); rebuilt from {entry.revision[:12]}, the "
                  f"newest revision whose manifest names the bytes it holds",
                  file=sys.stderr, flush=True)
            EventLog(pod_dir).emit("hub_mid_push_skipped", skipped=[e.revision for e in skipped],
                                   revision=entry.revision, reason=skipped[0].differing)
        return entry.revision, config
    raise skipped[0]


class MidPush(IntegrityError):
    """A revision whose manifest names other checkpoint bytes than the revision holds."""

    def __init__(self, revision: str, differing: str):
        super().__init__(f"revision {revision[:12]}: {differing}; refused")
        self.revision, self.differing = revision, differing


def _rebuild_at(pod_dir: Path, url: str, store, rev: str, on_cluster: bool,
                trust_config: bool, ray_address: str | None) -> PodConfig:
    tracked = store.files(rev)
    if CONFIG_NAME not in tracked:
        raise UserError(f"revision {rev[:12]} of {url} holds no {CONFIG_NAME}: not a pod "
                        f"pushed by fractus-pod")
    store.pull([CONFIG_NAME], rev)
    keep_hub(pod_dir, url, f"rebuilt from {url} at revision {rev}")
    config = load_pod_config(pod_dir)
    if not trust_config and (found := untrusted_config(config, pod_dir, ray_address)):
        raise UserError(refusal(url, found))      # before anything else is pulled
    store.pull([p for p in (config.manifest, config.stages, config.criteria, config.model)
                if p in tracked], rev)
    if not trust_config and config.stages in tracked and \
            (found := untrusted_stages(load_stages(pod_dir / config.stages), pod_dir)):
        raise UserError(refusal(url, found))
    manifest = read_manifest(pod_dir / config.manifest)
    if not manifest.exists:
        raise UserError(f"revision {rev[:12]} of {url} holds no manifest {config.manifest}")
    wanted, differing = [], []
    for gpu, entry in sorted(manifest.entries.items()):
        rel = entry.checkpoint
        if not rel:
            continue
        held = tracked.get(rel)
        if held is None or held.sha256 != entry.checkpoint_sha256:
            differing.append(f"gpu_{gpu}'s manifest names {rel} with other bytes than the "
                             f"revision holds")
        wanted.append(rel)
    if differing:
        raise MidPush(rev, "; ".join(differing))
    refuse_deleted(store, rev, tracked, wanted)
    # The merge rounds' state, verified before any checkpoint is pulled, installed after.
    with fetched_rounds(store, rev, tracked) as rounds:
        if not (on_cluster or config.ray is not None):
            store.pull(wanted, rev)
        rounds.install()
    for entry in manifest.entries.values():
        if entry.checkpoint:
            entry.note_hub_revision(rev)    # checked above: the revision holds its bytes
    write_manifest(manifest)
    for sub in ("checkpoints", "data", "logs"):
        (pod_dir / sub).mkdir(exist_ok=True)
    missing = [g for g in {s.gpu for s in parse_devices(config.devices)} | set(manifest.entries)
               if not (pod_dir / config.shard_path(g)).is_file()]
    if missing and config.demo_data and config.data is None:   # else launch fetches them
        write_demo_shards(pod_dir, config)
    return config
