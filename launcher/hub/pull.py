"""`fractus-pod sync pull`: files of one hub revision into a pod directory (or a new folder
with `--from URL`, through config_trust.py's filter). The manifest and the checkpoints it
names are never replaced by other bytes without `--force`: an old revision's checkpoint over
the newest one would silently move a GPU back."""

from __future__ import annotations

from pathlib import Path

from launcher.errors import UserError
from launcher.config.podconfig import PodConfig, load_pod_config
from launcher.paths import CONFIG_NAME
from launcher.pod.manifest import ManifestError, read_manifest
from launcher.hub.integrity import matches, pod_relpath
from launcher.config.stages import load_stages
from launcher.hub.config_trust import refusal, untrusted_config, untrusted_stages
from launcher.hub.from_hub import keep_hub
from launcher.hub.by_url import absolute_hub_url
from launcher.hub import open_store
from launcher.hub.lease import LEASE_PATH
from launcher.hub.store import remove_empty_dirs


def _live_files(pod_dir: Path, config: PodConfig) -> dict[str, str]:
    """Pod-relative path -> why it is live: the manifest and the checkpoints it names."""
    live = {config.manifest: "the pod's manifest"}
    try:
        entries = read_manifest(pod_dir / config.manifest).entries
    except ManifestError:
        return live
    for gpu, entry in entries.items():
        if entry.checkpoint:
            live[entry.checkpoint] = (f"GPU {gpu}'s resume point (token "
                                      f"{entry.start_token:,}) in the manifest")
    return live


def _refuse_overwriting_live(pod_dir: Path, config: PodConfig, wanted: list[str], index,
                             revision: str, url: str) -> None:
    live = {pod_relpath(rel): why for rel, why in _live_files(pod_dir, config).items()}
    for rel in wanted:
        if rel in live and (pod_dir / rel).exists() and not matches(pod_dir / rel, index[rel]):
            raise UserError(
                f"refusing to overwrite {rel}, {live[rel]}, with other bytes "
                f"from revision {revision[:12]}: add --force to replace it (the manifest keeps "
                f"its record and `status` flags the difference), or pull into a new folder: "
                f"fractus-pod --pod-dir NEW sync pull --from {url}")


def _refuse_untrusted(pod_dir: Path, store, revision: str, wanted: list[str], url: str) -> None:
    """Refuse an untrusted hub config (and stages) before anything is pulled; read in scratch."""
    with store.fetched(CONFIG_NAME, revision) as path:
        config = load_pod_config(path.parent)
    found = untrusted_config(config, pod_dir)
    if config.stages in wanted and config.stages in store.files(revision):
        with store.fetched(config.stages, revision) as path:
            found += untrusted_stages(load_stages(path), pod_dir)
    if found:
        raise UserError(refusal(url, found, "sync pull --from", "nothing was pulled"))


def pull_into_pod(pod_dir: Path, url: str | None, revision: str | None, paths: list[str],
                  force: bool, trust_config: bool = False) -> tuple[str, str, dict[str, Path]]:
    """Pull `paths` (default: all) of `revision` (default: newest) from `url` (default: the
    pod's `hub:`, trusted); returns (url, revision, {path: local file})."""
    config = load_pod_config(pod_dir) if (pod_dir / CONFIG_NAME).is_file() else None
    if url is None:
        if config is None:
            raise UserError(f"no {CONFIG_NAME} in {pod_dir}: to pull into a new folder name "
                            f"the hub, e.g. `sync pull --from hf://owner/repo`")
        if not config.hub:
            raise UserError(f"no hub configured: set `hub:` in {CONFIG_NAME} (file://DIR or "
                            f"hf://owner/repo), or give --from URL")
        url = config.hub
        trust_config = True        # the hub this pod's own config names: the user's choice
    else:
        url = absolute_hub_url(url, Path.cwd())
    store = open_store(url, pod_dir)
    revision = store.resolve(revision)
    index = store.files(revision)
    wanted = ([pod_relpath(p) for p in paths] if paths else
              [p for p in index if p != LEASE_PATH])     # the hub's own record, not a pod file
    if config is not None and not force:
        _refuse_overwriting_live(pod_dir, config, [p for p in wanted if p in index], index,
                                 revision, url)
    made = not pod_dir.exists()
    pod_dir.mkdir(parents=True, exist_ok=True)
    try:
        if not trust_config and CONFIG_NAME in wanted and CONFIG_NAME in index:
            _refuse_untrusted(pod_dir, store, revision, wanted, url)
        pulled = store.pull(wanted, revision)
    except BaseException:
        if made:             # a refused pull into a new folder leaves no folder behind
            remove_empty_dirs(pod_dir, pod_dir.parent)
        raise
    if CONFIG_NAME in pulled:
        keep_hub(pod_dir, url, f"pulled from {url} at revision {revision}")
    return url, revision, pulled
