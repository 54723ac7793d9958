"""What one hub push sends, decided on the supervision loop (hard links to the immutable
retained checkpoints and the manifest naming them: no copy, no hashing on the loop) and sent
off it as one revision, each checkpoint checked in the one read the store makes."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
import uuid
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from launcher.errors import UserError
from launcher.paths import CONFIG_NAME, MERGED_PATH, SNAPSHOT_DIR
from launcher.pod.ckpt_index import CheckpointIndex
from launcher.files import atomic_write_bytes
from launcher.pod.manifest import Manifest, ManifestEntry, event_phase
from launcher.config.podconfig import PodConfig
from launcher.pod.progress import progress
from launcher.hub.integrity import pod_relpath
from launcher.hub.lease import pod_id, push_as_writer
from launcher.hub.round_files import ROUND_FILE, round_files
from launcher.pod.ckpt_trust import check_entry


# ---- what one push sends -----------------------------------------------------------------
@dataclass
class Snapshot:
    dir: Path
    files: dict[str, Path] = field(default_factory=dict)      # hub path -> local file
    expected: dict[str, str] = field(default_factory=dict)    # hub path -> sha256 to check
    copies: dict[Path, Path] = field(default_factory=dict)    # link failed: copy src -> dest
    pushed: dict[int, tuple[str, str]] = field(default_factory=dict)  # gpu -> (path, sha256)
    # Pushed already by a remote backend's nodes: hub path -> revision (a merge reads it).
    on_hub: dict[str, str] = field(default_factory=dict)
    manifest_path: str = ""
    manifest_doc: dict = field(default_factory=dict)
    manifest: Manifest | None = None
    # PodConfig.shard_path, for the identity check of each merged checkpoint.
    shard_of: Callable[..., str] | None = None
    merge: bool = False
    # The merge rounds' files it carries (round_files.py): hub path -> the file to read,
    # and their identity (inode, size, mtime: each is replaced, never rewritten).
    rounds: dict[str, Path] = field(default_factory=dict)
    rounds_key: tuple = ()

    def checkpoints_key(self) -> tuple:
        """The checkpoints it holds (and whether it merges them)."""
        return tuple(sorted(self.pushed.items())), self.merge

    def key(self) -> tuple:
        """Checkpoints, manifest and round files: an unchanged pod is not pushed twice, a
        changed manifest or a new round is."""
        return self.checkpoints_key(), self.manifest_sha256(), self.rounds_key

    def drop(self) -> Callable[[str], bool] | None:
        """What the push stops naming: with a merged round file of its own, every other
        round file (the pod keeps only the newest; older revisions still name theirs and
        retention frees them as it frees old checkpoints). None without one: a push that
        carries no round file leaves the hub's as they are. Whatever landed before it, the
        revision it makes names one round state: its ledger and that ledger's round file."""
        return is_round_file if any(map(is_round_file, self.rounds)) else None

    def manifest_bytes(self) -> bytes:
        """The manifest file exactly as the push commits it."""
        return (json.dumps(self.manifest_doc, indent=2) + "\n").encode()

    def manifest_sha256(self) -> str:
        return hashlib.sha256(self.manifest_bytes()).hexdigest()

    def discard(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def is_round_file(path: str) -> bool:
    """A merged round file (`merge/round_NNNNN.pt`): a push carrying one drops the others."""
    return ROUND_FILE.match(path) is not None


def new_snapshot(pod_dir: Path, merge: bool = False) -> Snapshot:
    """An empty snapshot in its own directory under the pod's snapshot folder."""
    return Snapshot(pod_dir / SNAPSHOT_DIR / f"{time.strftime('%Y%m%dT%H%M%S')}-"
                                             f"{uuid.uuid4().hex[:6]}", merge=merge)


def pod_files(pod_dir: Path, config: PodConfig) -> list[str]:
    """The small files a rebuilt pod needs besides manifest and checkpoints."""
    names = [CONFIG_NAME, config.stages, config.criteria]
    if config.model.endswith((".json", ".yaml", ".yml")):
        names.append(config.model)
    out = []
    for name in names:
        try:
            rel = pod_relpath(name)
        except ValueError:
            continue          # outside the pod (an absolute path): not the pod's to send
        if (pod_dir / rel).is_file():
            out.append(rel)
    return out


def take_snapshot(pod_dir: Path, config: PodConfig, manifest: Manifest,
                  index: CheckpointIndex, merge: bool = False) -> Snapshot | None:
    """Each GPU's newest passed checkpoint, linked, plus the manifest naming them; None when
    no GPU has one yet. No file is read (`send` checks the bytes, off the loop)."""
    snap = new_snapshot(pod_dir, merge)
    entries = {}
    for gpu, entry in sorted(manifest.entries.items()):
        record = index.newest_passed(gpu, verify=False)
        if record is None:
            continue
        hub_path = config.checkpoint_path(gpu)
        local = snap.dir / f"gpu{gpu}.pt"
        local.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(pod_dir / record["path"], local)
        except OSError:
            snap.copies[pod_dir / record["path"]] = local    # no hard links here: copy later
        snap.files[hub_path] = local
        snap.expected[hub_path] = record["sha256"]
        snap.pushed[gpu] = (hub_path, record["sha256"])
        entries[gpu] = hub_entry(entry, record, hub_path,
                                 config.shard_path(gpu, event_phase(record)))
    if not entries:
        snap.discard()
        return None
    _add_manifest(snap, pod_dir, config, manifest, entries)
    return snap


def _with_fresh_starts(manifest: Manifest, entries: dict[int, ManifestEntry]) -> dict:
    """`entries` plus each GPU resuming at token 0 with no checkpoint (its stage is part of
    where the pod stands); a GPU whose checkpoint has not passed stays off."""
    fresh = {gpu: entry.copy() for gpu, entry in manifest.entries.items()
             if gpu not in entries and entry.checkpoint is None and entry.start_token == 0}
    return dict(sorted({**entries, **fresh}.items()))


def hub_entry(entry: ManifestEntry | None, record: dict, hub_path: str,
              shard: str) -> ManifestEntry:
    """The hub's entry for a GPU: the pod's `entry` with pushed index `record` at `hub_path`;
    `shard` (the config's) where the entry names none."""
    return (entry or ManifestEntry()).as_pushed(record, hub_path, shard)


def _add_manifest(snap: Snapshot, pod_dir: Path, config: PodConfig, manifest: Manifest,
                  entries: dict[int, ManifestEntry]) -> None:
    """The manifest naming `entries`, and the pod's small files, join the snapshot."""
    snap.manifest_path = config.manifest
    snap.manifest = Manifest(Path(config.manifest), _with_fresh_starts(manifest, entries),
                             dict(manifest.extra))
    snap.manifest_doc = snap.manifest.to_json()
    snap.shard_of = config.shard_path
    for rel in pod_files(pod_dir, config):
        snap.files[rel] = pod_dir / rel
    _add_rounds(snap, pod_dir)


def _add_rounds(snap: Snapshot, pod_dir: Path) -> None:
    """The merge rounds' state joins the snapshot, linked as the checkpoints are."""
    key = []
    for rel, src in round_files(pod_dir).items():
        local = snap.dir / rel
        local.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(src, local)
            snap.rounds[rel] = local
        except FileNotFoundError:
            continue                  # replaced or gone since it was listed: the next push
        except OSError:
            snap.copies[src] = local  # no hard links here: copied by `send`
            snap.rounds[rel] = src
        snap.files[rel] = local
        st = snap.rounds[rel].stat()
        key.append((rel, st.st_ino, st.st_size, st.st_mtime_ns))
    snap.rounds_key = tuple(sorted(key))


def take_manifest_snapshot(pod_dir: Path, config: PodConfig, manifest: Manifest,
                           on_hub: dict[int, dict], merge: bool = False) -> Snapshot | None:
    """A remote backend's push: only the manifest naming what the nodes pushed (`on_hub`:
    gpu -> index record) and the small files (with `merge`, their mean). None before any."""
    if not on_hub:
        return None
    snap = new_snapshot(pod_dir, merge)
    entries = {}
    for gpu, record in sorted(on_hub.items()):
        hub_path = config.checkpoint_path(gpu)
        snap.pushed[gpu] = (hub_path, record["sha256"])
        snap.on_hub[hub_path] = record["hub_revision"]
        entries[gpu] = hub_entry(manifest.entries.get(gpu), record, hub_path,
                                 config.shard_path(gpu, event_phase(record)))
    snap.dir.mkdir(parents=True, exist_ok=True)
    _add_manifest(snap, pod_dir, config, manifest, entries)
    return snap


def send(store, snap: Snapshot, message: str) -> str:
    """Write the manifest, merge if asked, push one revision (off the loop); HubError, OSError."""
    for src, dest in snap.copies.items():
        shutil.copyfile(src, dest)
    manifest_file = snap.dir / "manifest.json"
    atomic_write_bytes(manifest_file, snap.manifest_bytes())
    snap.files[snap.manifest_path] = manifest_file
    if snap.merge:
        from launcher.hub.merge import merge_checkpoints    # torch (~2 s): only to merge

        sha256_of = dict(snap.pushed.values())
        gpu_of = {path: gpu for gpu, (path, _sha) in snap.pushed.items()}

        def checkpoint(path: str):
            """A checkpoint of this push, or one a node pushed, pulled from its revision."""
            if path in snap.files:
                return nullcontext(snap.files[path])
            return store.fetched(path, snap.on_hub[path], sha256_of[path])

        def its_own(path: str, local: Path) -> None:
            """The launch's identity rules (GPU, shard, run, token) against the pushed entry."""
            check_entry(snap.manifest, store.pod_dir, gpu_of[path], snap.shard_of, path=local)

        try:
            merge_checkpoints([path for _, (path, _sha) in sorted(snap.pushed.items())],
                              snap.dir / "merged.pt", fetch=checkpoint, verify=its_own)
            snap.files[MERGED_PATH] = snap.dir / "merged.pt"
        except (ValueError, UserError) as exc:
            # A brain not to trust is not pushed; the checkpoints still are.
            print(f"fractus-pod: merged brain not pushed: {exc}", file=sys.stderr, flush=True)
    size = sum(path.stat().st_size for path in snap.files.values())
    with progress(f"hub push to {store.url}: {len(snap.files)} file(s), "
                  f"{size / 1e9:.2f} GB"):
        return push_as_writer(store, snap.files, message, snap.expected, snap.dir,
                              pod_id(store.pod_dir), drop=snap.drop())


def record_revision(manifest: Manifest, snap: Snapshot, revision: str) -> list[int]:
    """Note `revision` for each GPU whose manifest entry still names the pushed bytes."""
    noted = []
    for gpu, (hub_path, sha) in snap.pushed.items():
        if manifest.note_hub_revision(gpu, revision, sha, checkpoint=hub_path):
            noted.append(gpu)
    return noted
