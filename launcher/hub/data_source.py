"""The pod config's `data:` store: shard records at its pinned revision, and `data push`.
The one record of a shard's bytes is the dataset store's own hub index at that revision
(committed with the shards); the pod keeps only url and revision, since a second copy of
the hashes could disagree with the store."""

from __future__ import annotations

from pathlib import Path

from launcher.config.data_settings import DataSource
from launcher.errors import UserError
from launcher.files import FileEntry, file_entry
from launcher.pod.progress import progress

from .integrity import pod_relpath
from .retry import RetryPolicy
from .by_url import open_store
from .store import Store


def data_store(url: str, pod_dir: Path, retry: RetryPolicy) -> Store:
    try:
        return open_store(url, pod_dir, retry=retry)
    except ValueError as exc:
        raise UserError(f"data: {exc}") from None


def shard_paths_in_store(paths: list[str], url: str) -> list[str]:
    """Pod-relative shard paths (= their store paths); UserError for one outside the pod."""
    out = []
    for path in paths:
        try:
            out.append(pod_relpath(path))
        except ValueError:
            raise UserError(f"data: shard {path} is outside the pod, so {url} cannot hold "
                            f"it; set `shards:` to a path inside the pod (e.g. "
                            f"data/shard_gpu{{i}}.npy)") from None
    return out


def shard_records(store: Store, source: DataSource, paths: list[str]) -> dict[str, FileEntry]:
    """{shard: its recorded sha256 and size} at the pinned revision: one index read."""
    index = store.files(source.revision)
    missing = [p for p in paths if p not in index]
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4
                                          else "")
        raise UserError(f"data: revision {source.revision[:12]} of {source.url} records no "
                        f"{shown}; put the shards there with `fractus-pod data push --to "
                        f"{source.url}` (it writes the new revision into data:)")
    return {p: index[p] for p in paths}


def push_shards(pod_dir: Path, paths: list[str], url: str,
                retry: RetryPolicy) -> tuple[DataSource, list[str]]:
    """Upload the shards the store lacks (by sha256) in ONE revision; returns (the source
    naming a revision that records them all, the shards uploaded)."""
    paths = shard_paths_in_store(paths, url)
    absent = [p for p in paths if not (pod_dir / p).is_file()]
    if absent:
        raise UserError(f"data push: no shard at {', '.join(absent[:4])}; put the pod's "
                        f"shards there first (the config's `shards:`)")
    store = data_store(url, pod_dir, retry)
    # The config names the store as given (hf://...), a file store by its absolute path.
    named = store.url if url.startswith("file://") else url
    head = store.head()
    held = store.files(head) if head else {}
    local: dict[str, FileEntry] = {}
    with progress("data push: hashing", sum((pod_dir / p).stat().st_size for p in paths),
                  "bytes") as task:
        for rel in paths:
            local[rel] = file_entry(pod_dir / rel)
            task.update(advance=local[rel].size)
    upload = [p for p in paths if held.get(p) != local[p]]
    if not upload:
        return DataSource(named, head), []
    revision = store.push({p: pod_dir / p for p in upload},
                          f"fractus-pod data push: {len(upload)} shard(s)",
                          base=head, expected={p: local[p].sha256 for p in upload})
    return DataSource(named, revision), upload
