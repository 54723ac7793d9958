"""The resume manifest (checkpoints/RESUME_MANIFEST_8GPU.json): read, validate, update, write.

Two layouts are read:
    current  {"gpu_0": {"start_token": ..., ...}, "gpu_1": {...}, ...}
    older    {"gpus": {"0": {"start_token", "tokens_processed", "last_loss", ...}}}
and each is written back in the layout it was read in, keeping every field we do not know
where it was, so the user's own readers keep working at every write: the tracker's
one-liner `json.load(open(p))['gpu_3']['start_token']`, or `m['gpus']['3']['start_token']`.
A foreign field that means the same as start_token (`tokens_processed`) is kept equal to it.

Rules (issue 4): updated atomically, only from the workers' checkpoint events; a GPU's
start_token never moves backwards except through a recorded rollback.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from launcher.errors import UserError
from launcher.files import atomic_write_bytes, atomic_write_text  # noqa: F401 (re-exported)

# The per-GPU fields this launcher maintains, in the order they are written.
ENTRY_FIELDS = ("start_token", "checkpoint", "checkpoint_sha256", "shard", "stage", "ema_tf",
                "lb", "updated_at", "hub_revision")
_CURRENT_KEY = re.compile(r"^gpu_(\d+)$")
# Top-level field naming this run; every checkpoint a worker of the run writes records it.
RUN_ID_KEY = "run_id"


class ManifestError(UserError):
    """A malformed manifest: one line naming the problem, exit 2, nothing started."""


class BackwardsError(RuntimeError):
    """A start_token would move backwards outside a recorded rollback (a launcher bug)."""


@dataclass
class Manifest:
    path: Path
    entries: dict = field(default_factory=dict)   # gpu index -> dict of fields
    extra: dict = field(default_factory=dict)     # unknown top-level keys, kept as read
    layout: str = "current"                       # layout it was read in
    exists: bool = False
    gpus_at: int = 0                              # older layout: where "gpus" sat among keys

    def entry(self, gpu: int) -> dict:
        return self.entries.setdefault(gpu, {})

    def start_token(self, gpu: int) -> int:
        return int(self.entries.get(gpu, {}).get("start_token", 0))

    def to_json(self) -> dict:
        """The manifest in the layout it was read in (a new one: the current layout)."""
        entries = {gpu: _written_entry(self.entries[gpu], self.layout)
                   for gpu in sorted(self.entries)}
        if self.layout == "older":
            items = list(self.extra.items())
            items.insert(self.gpus_at, ("gpus", {str(gpu): e for gpu, e in entries.items()}))
            return dict(items)
        out = dict(self.extra)
        out.update({f"gpu_{gpu}": e for gpu, e in entries.items()})
        return out


# Foreign progress fields that mean the same as start_token: kept equal to it at every write.
SAME_AS_START_TOKEN = ("tokens_processed",)


def _written_entry(entry: dict, layout: str) -> dict:
    """One GPU's entry as written: ours first in the current layout; the user's own order in
    the older one (new fields after theirs)."""
    if layout == "older":
        ordered = dict(entry)
    else:
        ordered = {k: entry[k] for k in ENTRY_FIELDS if k in entry}
        ordered.update({k: v for k, v in entry.items() if k not in ordered})
    for name in SAME_AS_START_TOKEN:
        if name in ordered and "start_token" in ordered:
            ordered[name] = ordered["start_token"]
    return ordered


def recorded_stage(entries: dict, gpus=None) -> int | None:
    """The pod's stage as the manifest records it: the lowest of the GPUs' (of `gpus` if
    given), so no GPU runs above a stage it reached. None: nothing recorded (a new pod)."""
    stages = [e["stage"] for g, e in entries.items()
              if e.get("stage") is not None and (gpus is None or g in gpus)]
    return min(stages) if stages else None


def _no_duplicate_keys(pairs):
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise ManifestError(f"key {key!r} appears twice")
        seen[key] = value
    return seen


def read_manifest(path: str | Path) -> Manifest:
    """Parse either layout; a missing file is an empty manifest (a fresh pod)."""
    path = Path(path)
    if not path.exists():
        return Manifest(path)
    try:
        data = json.loads(path.read_text(), object_pairs_hook=_no_duplicate_keys)
    except ManifestError as exc:
        raise ManifestError(f"manifest {path}: {exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ManifestError(f"manifest {path}: invalid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ManifestError(f"manifest {path}: expected a JSON object at the top level")

    manifest = Manifest(path, exists=True)
    sources: dict[int, str] = {}

    def add(gpu_key: str, gpu: int, entry) -> None:
        if not isinstance(entry, dict):
            raise ManifestError(f"manifest {path}: {gpu_key} must be an object")
        if gpu in sources:
            raise ManifestError(f"manifest {path}: GPU {gpu} is listed twice "
                                f"({sources[gpu]} and {gpu_key})")
        sources[gpu] = gpu_key
        manifest.entries[gpu] = dict(entry)

    for key, value in data.items():
        match = _CURRENT_KEY.match(key)
        if match:
            add(key, int(match.group(1)), value)
        elif key == "gpus" and isinstance(value, dict):
            manifest.layout, manifest.gpus_at = "older", len(manifest.extra)
            for sub, entry in value.items():
                if not str(sub).isdigit():
                    raise ManifestError(f"manifest {path}: gpus key {sub!r} is not a GPU index")
                add(f"gpus.{sub}", int(sub), entry)
        else:
            manifest.extra[key] = value
    for gpu, entry in manifest.entries.items():
        _check_start_token(path, gpu, entry)
        _check_field_types(path, gpu, entry)
    run_id = manifest.extra.get(RUN_ID_KEY)
    if run_id is not None and (not isinstance(run_id, str) or not run_id):
        raise ManifestError(f"manifest {path}: {RUN_ID_KEY} must be a non-empty string, "
                            f"got {run_id!r} (delete it and the next launch records a new one)")
    return manifest


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# The fields the launcher reads, and what each must hold when present (null allowed where
# a GPU may not have it yet). Fields it does not read are kept as they are, unchecked.
_FIELD_TYPES = {
    "checkpoint": ("a path string", lambda v: isinstance(v, str) and bool(v)),
    "checkpoint_sha256": ("a 64-digit hex sha256",
                          lambda v: isinstance(v, str) and re.fullmatch(r"[0-9a-f]{64}", v)),
    "shard": ("a path string", lambda v: isinstance(v, str) and bool(v)),
    "stage": ("an integer >= 1", lambda v: isinstance(v, int) and not isinstance(v, bool)
              and v >= 1),
    "ema_tf": ("a number", _is_number),
    "lb": ("a number", _is_number),
    "updated_at": ("a number (unix time)", _is_number),
    "hub_revision": ("a revision string", lambda v: isinstance(v, str) and bool(v)),
}


def _check_field_types(path: Path, gpu: int, entry: dict) -> None:
    for name, (wanted, ok) in _FIELD_TYPES.items():
        value = entry.get(name)
        if value is not None and not ok(value):
            raise ManifestError(f"manifest {path}: gpu_{gpu} {name} must be {wanted}, got "
                                f"{value!r}; fix or remove that field")


def _check_start_token(path: Path, gpu: int, entry: dict) -> None:
    if "start_token" not in entry:
        raise ManifestError(f"manifest {path}: gpu_{gpu} has no start_token")
    token = entry["start_token"]
    if isinstance(token, bool) or not isinstance(token, int):
        raise ManifestError(f"manifest {path}: gpu_{gpu} start_token must be an integer, "
                            f"got {token!r}")
    if token < 0:
        raise ManifestError(f"manifest {path}: gpu_{gpu} start_token is negative ({token})")


def name_default_checkpoints(manifest: Manifest, pod_dir: Path, checkpoint_path_of) -> None:
    """An entry with progress but no `checkpoint` field (the reference tracker writes only
    start_token) resumes from the GPU's own file, v1's default, when it is there."""
    for gpu, entry in manifest.entries.items():
        if not entry.get("checkpoint") and (pod_dir / checkpoint_path_of(gpu)).is_file():
            entry["checkpoint"] = checkpoint_path_of(gpu)


def validate_for_launch(manifest: Manifest, pod_dir: Path, gpus: list[int],
                        shard_path_of, shard_length_of, on_hub=frozenset()) -> None:
    """Everything `launch` needs before it starts anything. Raises ManifestError. `on_hub`:
    GPUs whose checkpoint is on the hub, for their Ray node to fetch (not on this disk)."""
    where = f"manifest {manifest.path}"
    for gpu in gpus:
        entry = manifest.entries.get(gpu)
        named = entry.get("shard") if entry else None
        if named and os.path.normpath(named) != os.path.normpath(shard_path_of(gpu)):
            raise ManifestError(f"{where}: gpu_{gpu} trained on shard {named} but the pod "
                                f"config's shards: names {shard_path_of(gpu)}; make "
                                f"shards: in fractus-pod.yaml name the manifest's shard")
        shard = pod_dir / (named or shard_path_of(gpu))
        if not shard.is_file():
            raise ManifestError(f"shard for GPU {gpu} not found: {shard}")
        if entry is None:
            continue
        length = shard_length_of(shard)
        if entry["start_token"] > length:
            raise ManifestError(f"{where}: gpu_{gpu} start_token {entry['start_token']} is past "
                                f"the end of its shard {shard} ({length} tokens)")
        ckpt = entry.get("checkpoint")
        if ckpt:
            try:
                resolve_in_pod(ckpt, pod_dir)
            except ValueError as exc:
                raise ManifestError(f"{where}: gpu_{gpu} checkpoint {exc}; checkpoints must "
                                    "live inside the pod (copy the file in and name it "
                                    "relative to the pod)") from None
        if ckpt and gpu not in on_hub and not (pod_dir / ckpt).is_file():
            raise ManifestError(f"{where}: gpu_{gpu} checkpoint {ckpt} does not exist")
        if entry["start_token"] > 0 and not ckpt:
            raise ManifestError(f"{where}: gpu_{gpu} has progress (start_token "
                                f"{entry['start_token']}) but names no checkpoint")


def write_manifest(manifest: Manifest) -> None:
    """Atomic: a temp file in the same directory, fsync, rename."""
    manifest.path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(manifest.path, json.dumps(manifest.to_json(), indent=2) + "\n")
    manifest.exists = True


def resolve_in_pod(name: str | Path, pod_dir: Path) -> Path:
    """Where a manifest path really points (symlinks followed), which must be inside the
    pod: a checkpoint outside it would be hard-linked under retained/ and pushed to the hub.
    An absolute path is allowed when it resolves inside the pod. Raises ValueError."""
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
    """Advance a GPU's entry from a worker's checkpoint event. False if it was stale.

    An event whose next_token is behind the entry is refused (BackwardsError) unless it
    repeats what is already recorded: only a rollback may move a GPU backwards."""
    entry = manifest.entry(gpu)
    next_token = int(event["next_token"])
    current = entry.get("start_token")
    if current is not None and next_token < current:
        raise BackwardsError(f"gpu_{gpu}: checkpoint at token {next_token} is behind the "
                             f"manifest ({current}); refused")
    if current == next_token and entry.get("checkpoint_sha256") == event.get("sha256"):
        return False
    _forget_hub_revision(entry, event.get("sha256"))
    entry.update({
        "start_token": next_token,
        "checkpoint": relative_to_pod(event["path"], pod_dir),
        "checkpoint_sha256": event.get("sha256"),
        "shard": shard,
        "stage": stage,
        "ema_tf": event.get("ema_tf"),
        "lb": event.get("lb"),
        "updated_at": time.time(),
    })
    return True


def _forget_hub_revision(entry: dict, new_sha256: str | None) -> None:
    """`hub_revision` names the hub commit holding the entry's checkpoint bytes: once the
    entry names other bytes it would restore the wrong file, so it goes until the next sync
    pushes the new checkpoint (launcher/hub/sync.py records it again)."""
    if entry.get("checkpoint_sha256") != new_sha256:
        entry.pop("hub_revision", None)


def apply_rollback(manifest: Manifest, gpu: int, target: dict, stage: int) -> dict:
    """Set a GPU back to a passed checkpoint `target` (a checkpoint-index record).

    Returns the entry it replaced; the caller records the rollback in events first."""
    entry = manifest.entry(gpu)
    before = dict(entry)
    _forget_hub_revision(entry, target["sha256"])
    entry.update({
        "start_token": int(target["next_token"]),
        "checkpoint": target["path"],
        "checkpoint_sha256": target["sha256"],
        "stage": stage,
        "ema_tf": target.get("ema_tf"),
        "lb": target.get("lb"),
        "updated_at": time.time(),
    })
    return before
