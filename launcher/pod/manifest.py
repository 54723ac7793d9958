"""The resume manifest (checkpoints/RESUME_MANIFEST_8GPU.json): read, validate, update, write.

Always: written atomically, only from checkpoint events, recorded rollbacks and restores; a
start_token moves backwards only through a recorded rollback. Either layout (gpu_N, older
gpus.N) is written back as read, unknown fields in place (docs/LAUNCHER.md, The manifest).
The pod's recorded stage is derived here only.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from launcher.errors import UserError
from launcher.files import atomic_write_text
from launcher.pod.manifest_entry import ENTRY_FIELDS, EntryError, ManifestEntry  # noqa: F401

_CURRENT_KEY = re.compile(r"gpu_([0-9]+)", re.ASCII)
_ASCII_INDEX = re.compile(r"[0-9]+", re.ASCII)
# Deeper nesting is a mistake, and a very deep one overflows the stack (RecursionError).
MAX_DEPTH = 32
# Top-level field naming this run; every checkpoint a worker of the run writes records it.
RUN_ID_KEY = "run_id"


class ManifestError(UserError):
    """A malformed manifest: one line naming the problem, exit 2, nothing started."""


class BackwardsError(RuntimeError):
    """A start_token would move backwards outside a recorded rollback (a launcher bug)."""


@dataclass
class Manifest:
    path: Path
    entries: dict[int, ManifestEntry] = field(default_factory=dict)   # by GPU index
    extra: dict = field(default_factory=dict)     # unknown top-level keys, kept as read
    layout: str = "current"                       # layout it was read in
    exists: bool = False
    gpus_at: int = 0                              # older layout: where "gpus" sat among keys

    def start_token(self, gpu: int) -> int:
        entry = self.entries.get(gpu)
        return entry.start_token if entry else 0

    def to_json(self) -> dict:
        """The manifest in the layout it was read in (a new one: the current layout)."""
        entries = {gpu: self.entries[gpu].to_json(self.layout) for gpu in sorted(self.entries)}
        if self.layout == "older":
            items = list(self.extra.items())
            items.insert(self.gpus_at, ("gpus", {str(gpu): e for gpu, e in entries.items()}))
            return dict(items)
        out = dict(self.extra)
        out.update({f"gpu_{gpu}": e for gpu, e in entries.items()})
        return out

    # ---- the pod's stage: derived here only ----------------------------------------------
    def recorded_stages(self, gpus=None) -> list[int]:
        """The distinct stages the entries record (of `gpus` if given), lowest first."""
        return sorted({e.stage for g, e in self.entries.items()
                       if e.stage is not None and (gpus is None or g in gpus)})

    def recorded_phases(self) -> list[int]:
        """The distinct data phases the entries are in, lowest first."""
        return sorted({e.at_phase for e in self.entries.values()})

    def recorded_stage(self, gpus=None) -> int | None:
        """The lowest stage the GPUs record, so no GPU runs above a stage it reached; None: none."""
        stages = self.recorded_stages(gpus)
        return stages[0] if stages else None

    def set_stage(self, stage: int, gpus=None) -> None:
        for gpu, entry in self.entries.items():
            if gpus is None or gpu in gpus:
                entry.set_stage(stage)

    # ---- the other named updates ---------------------------------------------------------
    def note_hub_revision(self, gpu: int, revision: str, sha256: str,
                          checkpoint: str | None = None) -> bool:
        """Record `revision` if the entry still names exactly these bytes (and path); True if so."""
        entry = self.entries.get(gpu)
        if entry is None or entry.checkpoint_sha256 != sha256 or \
                (checkpoint is not None and entry.checkpoint != checkpoint):
            return False
        entry.note_hub_revision(revision)
        return True

    def reset_entry(self, gpu: int, entry: ManifestEntry | None) -> None:
        """Put back an entry as it was; None: the GPU has none (a fresh start)."""
        if entry is None:
            self.entries.pop(gpu, None)
        else:
            self.entries[gpu] = entry.copy()

    def add_entry(self, gpu: int, entry: ManifestEntry) -> None:
        if gpu in self.entries:
            raise ValueError(f"GPU {gpu} already has a manifest entry")
        self.entries[gpu] = entry


def current_stage(running_state: dict | None, manifest: Manifest | None) -> int | None:
    """The pod's stage: the running launcher's, else the lowest the manifest records."""
    stage = (running_state or {}).get("stage")
    if stage is None and manifest is not None:
        stage = manifest.recorded_stage()
    return stage


def _no_duplicate_keys(pairs):
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise ManifestError(f"key {key!r} appears twice; keep one of them")
        seen[key] = value
    return seen


def _numeric_not_ascii(key: str) -> bool:
    """A GPU key with non-ASCII digits ("gpu_١"): refused, not kept as a foreign field."""
    index = key[len("gpu_"):] if key.startswith("gpu_") else ""
    return bool(index) and all(ch.isnumeric() for ch in index)


def _refuse_constant(name: str):
    raise ManifestError(f"{name} is not JSON (write a number, or null)")


def _depth(value, limit: int) -> int:
    """Nesting depth of parsed JSON, walked without recursion; stops past `limit`."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if deepest > limit:
                return deepest
            stack.extend((child, depth + 1) for child in
                         (item.values() if isinstance(item, dict) else item))
    return deepest


def read_manifest(path: str | Path) -> Manifest:
    """Parse either layout; a missing file is an empty manifest (a fresh pod)."""
    path = Path(path)
    if not path.exists():
        return Manifest(path)
    if path.is_dir():
        raise ManifestError(f"manifest {path} is a directory, not a file; set manifest: in "
                            f"fractus-pod.yaml to the JSON file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=_no_duplicate_keys,
                          parse_constant=_refuse_constant)
    except ManifestError as exc:
        raise ManifestError(f"manifest {path}: {exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ManifestError(f"manifest {path}: invalid JSON ({exc}); fix it, or restore it "
                            f"with `fractus-pod sync pull`") from None
    except RecursionError:
        raise ManifestError(f"manifest {path}: nested deeper than {MAX_DEPTH} levels; remove "
                            f"the deeply nested field") from None
    except OSError as exc:
        raise ManifestError(f"manifest {path}: cannot read it ({exc.strerror}); fix its "
                            f"permissions") from None
    if not isinstance(data, dict):
        raise ManifestError(f"manifest {path}: expected a JSON object at the top level "
                            f"(e.g. {{\"gpu_0\": {{\"start_token\": 0}}}}); see docs/LAUNCHER.md, "
                            f"The manifest")
    if _depth(data, MAX_DEPTH) > MAX_DEPTH:
        raise ManifestError(f"manifest {path}: nested deeper than {MAX_DEPTH} levels; remove "
                            f"the deeply nested field")

    manifest = Manifest(path, exists=True)
    sources: dict[int, str] = {}
    raw_entries: dict[int, dict] = {}

    def add(gpu_key: str, gpu: int, entry) -> None:
        if not isinstance(entry, dict):
            raise ManifestError(f"manifest {path}: {gpu_key} must be an object (e.g. "
                                f"{{\"start_token\": 0}})")
        if gpu in sources:
            raise ManifestError(f"manifest {path}: GPU {gpu} is listed twice "
                                f"({sources[gpu]} and {gpu_key}); keep one of them")
        sources[gpu] = gpu_key
        raw_entries[gpu] = entry

    for key, value in data.items():
        match = _CURRENT_KEY.fullmatch(key)
        if match:
            add(key, int(match.group(1)), value)
        elif _numeric_not_ascii(key):
            raise ManifestError(f"manifest {path}: key {key!r} is not a GPU index; name GPUs "
                                f"gpu_0, gpu_1, ... (ASCII digits)")
        elif key == "gpus":
            if not isinstance(value, dict):
                raise ManifestError(f"manifest {path}: gpus must be an object of GPU index -> "
                                    f"entry (e.g. {{\"0\": {{\"start_token\": 0}}}}), got "
                                    f"{type(value).__name__}")
            manifest.layout, manifest.gpus_at = "older", len(manifest.extra)
            for sub, entry in value.items():
                if not _ASCII_INDEX.fullmatch(sub):
                    raise ManifestError(f"manifest {path}: gpus key {sub!r} is not a GPU "
                                        f"index; use \"0\", \"1\", ... (ASCII digits)")
                add(f"gpus.{sub}", int(sub), entry)
        else:
            manifest.extra[key] = value
    for gpu, raw in raw_entries.items():       # typed once, here, after the layout checks
        try:
            manifest.entries[gpu] = ManifestEntry.parse(raw, gpu)
        except EntryError as exc:
            raise ManifestError(f"manifest {path}: {exc}") from None
    run_id = manifest.extra.get(RUN_ID_KEY)
    if run_id is not None and (not isinstance(run_id, str) or not run_id):
        raise ManifestError(f"manifest {path}: {RUN_ID_KEY} must be a non-empty string, "
                            f"got {run_id!r} (delete it and the next launch records a new one)")
    return manifest


def name_default_checkpoints(manifest: Manifest, pod_dir: Path, checkpoint_path_of) -> None:
    """Entries naming no checkpoint (the reference tracker writes only start_token) resume
    from the GPU's own file when it is there."""
    for gpu, entry in manifest.entries.items():
        if not entry.checkpoint and (pod_dir / checkpoint_path_of(gpu)).is_file():
            entry.name_checkpoint(checkpoint_path_of(gpu))


def validate_for_launch(manifest: Manifest, pod_dir: Path, gpus: list[int],
                        shard_path_of, shard_length_of, on_hub=frozenset(),
                        shards_elsewhere=frozenset()) -> None:
    """Everything `launch` needs before it starts anything; raises ManifestError. `on_hub`,
    `shards_elsewhere`: GPUs whose Ray node fetches its checkpoint, its shard (not on this disk)."""
    where = f"manifest {manifest.path}"
    for gpu in gpus:
        entry = manifest.entries.get(gpu)
        named = entry.shard if entry else None
        configured = phase_shard(manifest, gpu, shard_path_of)
        if named and os.path.normpath(named) != os.path.normpath(configured):
            raise ManifestError(f"{where}: gpu_{gpu} trained on shard {named} but the pod "
                                f"config's shards: names {configured}; make "
                                f"shards: in fractus-pod.yaml name the manifest's shard")
        shard = pod_dir / (named or configured)
        shard_here = gpu not in shards_elsewhere
        if shard_here and not shard.is_file():
            raise ManifestError(f"shard for GPU {gpu} not found: {shard}; put it there or fix "
                                f"shards: in fractus-pod.yaml")
        if entry is None:
            continue
        length = shard_length_of(shard) if shard_here else None
        if length is not None and entry.start_token > length:
            raise ManifestError(f"{where}: gpu_{gpu} start_token {entry.start_token} is past "
                                f"the end of its shard {shard} ({length} tokens)")
        ckpt = entry.checkpoint
        if ckpt:
            try:
                resolve_in_pod(ckpt, pod_dir)
            except ValueError as exc:
                raise ManifestError(f"{where}: gpu_{gpu} checkpoint {exc}; checkpoints must "
                                    "live inside the pod (copy the file in and name it "
                                    "relative to the pod)") from None
        if ckpt and gpu not in on_hub and not (pod_dir / ckpt).is_file():
            raise ManifestError(checkpoint_not_a_file(where, gpu, ckpt, pod_dir))
        if entry.start_token > 0 and not ckpt:
            raise ManifestError(f"{where}: gpu_{gpu} has progress (start_token "
                                f"{entry.start_token}) but names no checkpoint")


def phase_shard(manifest: Manifest, gpu: int, shard_path_of) -> str:
    """The config's shard for the data phase the GPU's entry is in; ManifestError if unlisted."""
    entry = manifest.entries.get(gpu)
    phase = entry.at_phase if entry else 1
    try:
        return shard_path_of(gpu, phase)
    except ValueError as exc:
        raise ManifestError(f"manifest {manifest.path}: gpu_{gpu} is in data phase {phase} "
                            f"but {exc}; list that phase's shard in shards: of "
                            f"fractus-pod.yaml") from None


def checkpoint_not_a_file(where: str, gpu: int, name: str, pod_dir: Path) -> str:
    """The refusal for a named checkpoint that is no regular file, saying what is there."""
    path = pod_dir / name
    if path.is_dir():
        found = "is a directory, not a checkpoint file"
    elif path.exists():
        found = "is not a regular file (a FIFO, socket or device)"
    else:
        found = "does not exist"
    return (f"{where}: gpu_{gpu} checkpoint {name} {found}; put the file back, or roll the "
            f"GPU back with `fractus-pod rollback --gpu {gpu} --to-stage N`")


def write_manifest(manifest: Manifest) -> None:
    """Atomic: a temp file in the same directory, fsync, rename."""
    manifest.path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(manifest.path, json.dumps(manifest.to_json(), indent=2) + "\n")
    manifest.exists = True


def resolve_in_pod(name: str | Path, pod_dir: Path) -> Path:
    """Where a manifest path really points (symlinks followed); ValueError outside the pod
    (a checkpoint there would be hard-linked under retained/ and pushed to the hub)."""
    root = pod_dir.resolve()
    target = (pod_dir / name).resolve()
    if target != root and root not in target.parents:
        raise ValueError(f"{name} resolves outside the pod directory ({target})")
    return target


def relative_to_pod(path: str | Path, pod_dir: Path) -> str:
    path = Path(path)
    if not path.is_absolute():
        return str(path)
    try:
        return str(path.resolve().relative_to(pod_dir.resolve()))
    except ValueError:
        return str(path)


def apply_checkpoint(manifest: Manifest, gpu: int, event: dict, stage: int, pod_dir: Path,
                     shard: str) -> bool:
    """Advance a GPU's entry from a worker's checkpoint event; False if it repeats the entry.
    BackwardsError if behind it. `shard`: the shard of the event's data phase."""
    entry = manifest.entries.get(gpu)
    next_token = int(event["next_token"])
    phase = event_phase(event)
    if entry is not None:
        if (phase, next_token) < entry.position:
            raise BackwardsError(f"gpu_{gpu}: checkpoint at phase {phase} token {next_token} "
                                 f"is behind the manifest (phase {entry.at_phase} token "
                                 f"{entry.start_token}); refused")
        if entry.position == (phase, next_token) and \
                entry.checkpoint_sha256 == event.get("sha256"):
            return False
    else:
        entry = manifest.entries[gpu] = ManifestEntry(start_token=next_token)
    entry.advance(next_token, relative_to_pod(event["path"], pod_dir), event.get("sha256"),
                  shard, stage, event.get("ema_tf"), event.get("lb"), phase)
    return True


def event_position(event: dict) -> tuple[int, int]:
    """(phase, next_token) of a checkpoint event or index record: the order of progress."""
    return event_phase(event), int(event["next_token"])


def event_phase(event: dict) -> int:
    """The data phase of a checkpoint event or index record; 1 when it records none."""
    phase = event.get("phase")
    return phase if isinstance(phase, int) and not isinstance(phase, bool) and phase >= 1 else 1


def apply_rollback(manifest: Manifest, gpu: int, target: dict, stage: int) -> ManifestEntry:
    """Set a GPU back to checkpoint-index record `target`; returns the entry it replaced."""
    entry = manifest.entries.setdefault(gpu, ManifestEntry())
    before = entry.copy()
    entry.roll_back(target, stage)
    return before
