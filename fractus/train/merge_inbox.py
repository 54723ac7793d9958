"""A worker's merge inbox: adopt a round's merged weights in place, or refuse the file and
change nothing. Owner: the worker (fractus/train/worker.py); inactive unless MERGE_INBOX is set.

The launcher's merge round (docs/WORKER.md, "Merge rounds") writes `merge/round_{n:05d}.pt`
({"format": MERGED_FORMAT, "round": n, "params": {name: tensor}}) and then, atomically, the
inbox JSON {"round": n, "path": <relative to the pod dir>, "sha256": <the file's>}. The
worker's pod dir is its working directory (the launcher starts it there). How the worker
uses this module, and how the orchestration is meant to drive it:

    inbox = MergeInbox(settings.merge_inbox, pod_dir=Path.cwd())
    entry = inbox.poll()       # at each step boundary: one stat; read only when it changed
    if entry is not None and entry.round > merge_round:
        params = read_merged(entry, inbox.pod_dir, model)   # MergeRefused: one line
        adopt(model, params)   # in place; then the `merge_adopted` event

Invariants:
- Verification comes first and is whole (MergeRefused before any tensor moves): the path
  stays inside the pod dir (no absolute path, no '..', no symlink out), the bytes have the
  inbox's sha256 (hashed and loaded through one open file: a rename cannot swap them), a
  weights-only load, the format and round, every learned parameter present (by any of its
  tied names), each with the parameter's shape and a floating dtype, all finite; no
  carried-state buffer (attn_S, attn_z, kuramoto_phases, thought_state, last_lb_loss: one
  GPU's stream, never merged) and no unknown or integer tensor.
- Adoption copies into the parameters' own storage (`param.data.copy_` under no_grad): no
  tensor is replaced, so the optimizer's per-parameter state (keyed by the parameter
  objects: SGD momentum) stays attached, and a compiled step sees the very tensors it was
  traced with: no recompile, and a CUDA-graph capture would stay valid. RNG, data position, carried state and optimizer state are the
  worker's own and untouched.
- Constant buffers the model's construction computes (attn.level_offsets, moe.expert_phases)
  are accepted in the file, when finite and of the buffer's shape, and left as built: never
  trained, the same on every GPU (a mean of them may differ by an ulp).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import torch

from fractus.legacy import _is_carried, read_checkpoint
from fractus.train.checkpoint import all_finite

MERGED_FORMAT = "fractus-pod-merged-v1"
MAX_ROUND = 10**9
MAX_GPUS = 4096
MAX_TOKEN = 10**18
MAX_INBOX_BYTES = 64 * 1024
_HASH_CHUNK = 1 << 20


class MergeRefused(ValueError):
    """A merged file (or inbox) this worker will not adopt; the message is one line."""

    def __init__(self, round_: int | None, reason: str):
        super().__init__(reason)
        self.round = round_
        self.reason = reason


@dataclass(frozen=True)
class InboxEntry:
    round: int
    path: str | None           # relative to the pod dir; None for a refused round
    sha256: str | None
    boundary: int | None = None    # the round boundary it decides; None: a stage end's
    gpus: dict | None = None       # the quorum, {gpu: its next token}; None: every GPU, now
    stage: int | None = None       # the stage whose boundaries it counts; None: any

    @property
    def refused(self) -> bool:
        return self.path is None

    def adopts(self, gpu: int, next_token: int) -> bool:
        """Whether a worker of `gpu` at `next_token` takes this round's weights."""
        return not self.refused and (self.gpus is None or self.gpus.get(gpu) == next_token)

    def decides(self, boundary: int, stage: int | None) -> bool:
        """Whether this entry settles round boundary `boundary` (or a later one) of `stage`
        (a rollback to another stage counts its boundaries anew)."""
        return self.boundary is not None and self.boundary >= boundary \
            and (self.stage is None or stage is None or self.stage == stage)


def parse_inbox(data, round_hint: int | None = None) -> InboxEntry:
    """The inbox's JSON object, every field checked; MergeRefused otherwise."""
    if not isinstance(data, dict):
        raise MergeRefused(round_hint, f"inbox is not a JSON object: {type(data).__name__}")
    round_ = data.get("round")
    if isinstance(round_, bool) or not isinstance(round_, int) or not 1 <= round_ <= MAX_ROUND:
        raise MergeRefused(None, f"inbox round must be an integer in 1..{MAX_ROUND}, got "
                                 f"{round_!r}"[:200])
    boundary, gpus = data.get("boundary"), data.get("gpus")
    if boundary is not None and (isinstance(boundary, bool) or not isinstance(boundary, int)
                                 or not 1 <= boundary <= MAX_ROUND):
        raise MergeRefused(round_, f"inbox boundary must be an integer in 1..{MAX_ROUND}, "
                                   f"got {boundary!r}"[:200])
    stage = data.get("stage")
    if stage is not None and (isinstance(stage, bool) or not isinstance(stage, int)
                              or not 1 <= stage <= 1000):
        raise MergeRefused(round_, f"inbox stage must be an integer in 1..1000, got "
                                   f"{stage!r}"[:200])
    if gpus is not None:
        if not isinstance(gpus, dict) or len(gpus) > MAX_GPUS or not all(
                isinstance(g, str) and g.isdigit() and len(g) < 6 and isinstance(t, int)
                and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN for g, t in gpus.items()):
            raise MergeRefused(round_, f"inbox gpus must map GPU numbers to tokens, got "
                                       f"{gpus!r}"[:200])
        gpus = {int(g): t for g, t in gpus.items()}
    if data.get("refused") is True:
        return InboxEntry(round_, None, None, boundary, {}, stage)
    path, digest = data.get("path"), data.get("sha256")
    if not isinstance(path, str) or not path:
        raise MergeRefused(round_, f"inbox path must be a non-empty string, got {path!r}"[:200])
    if (not isinstance(digest, str) or len(digest) != 64
            or any(c not in "0123456789abcdef" for c in digest)):
        raise MergeRefused(round_, f"inbox sha256 must be 64 lowercase hex digits, got "
                                   f"{digest!r}"[:200])
    return InboxEntry(round_, path, digest, boundary, gpus, stage)


def merged_file(entry: InboxEntry, pod_dir: Path) -> Path:
    """The entry's file inside `pod_dir`: refused when absolute, holding '..', or resolving
    (symlinks followed) outside it."""
    relative = PurePosixPath(entry.path)
    if relative.is_absolute() or Path(entry.path).is_absolute() or "\\" in entry.path:
        raise MergeRefused(entry.round, f"merged path {entry.path!r} is absolute; it must be "
                                        f"relative to the pod dir")
    if ".." in relative.parts:
        raise MergeRefused(entry.round, f"merged path {entry.path!r} holds '..'")
    root = pod_dir.resolve()
    path = (root / relative).resolve()
    if not path.is_relative_to(root):
        raise MergeRefused(entry.round, f"merged path {entry.path!r} leads outside the pod dir")
    return path


class MergeInbox:
    """The inbox file at `path` (relative to `pod_dir`, the worker's working directory);
    `poll()` costs one stat while it is unchanged."""

    def __init__(self, path: str | os.PathLike, pod_dir: Path):
        self.pod_dir = Path(pod_dir)
        self.path = self.pod_dir / path
        self._seen: tuple | None = None   # (ino, size, mtime_ns) of the content last read
        self.entry: InboxEntry | None = None   # the newest entry read that parsed

    def poll(self) -> InboxEntry | None:
        """The entry when the file changed since the last read; None when it is absent or
        unchanged. MergeRefused when it changed and does not parse."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self._seen, self.entry = None, None
            return None
        if (st.st_ino, st.st_size, st.st_mtime_ns) == self._seen:
            return None
        try:
            with open(self.path, "rb") as f:
                st = os.fstat(f.fileno())      # the signature of the bytes read here
                self._seen = (st.st_ino, st.st_size, st.st_mtime_ns)
                raw = f.read(MAX_INBOX_BYTES + 1)
        except FileNotFoundError:
            self._seen = None
            return None
        except OSError as e:
            raise MergeRefused(None, f"cannot read inbox {self.path}: {e}") from None
        if len(raw) > MAX_INBOX_BYTES:
            raise MergeRefused(None, f"inbox {self.path} is over {MAX_INBOX_BYTES} bytes")
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise MergeRefused(None, f"inbox {self.path} is not JSON: {e}"[:300]) from None
        self.entry = parse_inbox(data)
        return self.entry


def _hash_open_file(f) -> str:
    digest = hashlib.sha256()
    for chunk in iter(lambda: f.read(_HASH_CHUNK), b""):
        digest.update(chunk)
    return digest.hexdigest()


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return _hash_open_file(f)


def _load_verified(path: Path, entry: InboxEntry) -> dict:
    """Hash then weights-only load the one open file (its inode: a rename cannot swap the
    bytes between the two); mmap through /proc/self/fd where there is one."""
    try:
        f = open(path, "rb")
    except OSError as e:
        raise MergeRefused(entry.round, f"cannot open merged file {entry.path}: "
                                        f"{e.strerror or e}") from None
    with f:
        digest = _hash_open_file(f)
        if digest != entry.sha256:
            raise MergeRefused(entry.round, f"merged file {entry.path} has sha256 "
                                            f"{digest[:16]}..., the inbox says "
                                            f"{entry.sha256[:16]}...")
        by_fd = Path(f"/proc/self/fd/{f.fileno()}")
        try:
            if by_fd.exists():
                return read_checkpoint(str(by_fd), mmap=True)
            f.seek(0)
            return torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:      # CheckpointLoadError, or torch's own
            text = str(e).replace(str(by_fd), entry.path)
            raise MergeRefused(entry.round, f"merged file {entry.path}: {text}"[:300]) from None


def learned_names(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Every name of every parameter (tied ones under each of their names)."""
    return dict(model.named_parameters(remove_duplicate=False))


def read_merged(entry: InboxEntry, pod_dir: Path, model: torch.nn.Module) -> dict:
    """{parameter name: tensor} of the entry's merged file, fully verified against `model`
    (module docstring); MergeRefused, one line, otherwise. Holds one name per parameter."""
    ck = _load_verified(merged_file(entry, pod_dir), entry)
    if not isinstance(ck, dict) or ck.get("format") != MERGED_FORMAT:
        shown = ck.get("format") if isinstance(ck, dict) else type(ck).__name__
        raise MergeRefused(entry.round, f"merged file format {shown!r}, expected "
                                        f"{MERGED_FORMAT!r}"[:200])
    if isinstance(ck.get("round"), bool) or ck.get("round") != entry.round:
        raise MergeRefused(entry.round, f"merged file holds round {ck.get('round')!r}, the "
                                        f"inbox says {entry.round}"[:200])
    given = ck.get("params")
    if not isinstance(given, dict) or not given:
        raise MergeRefused(entry.round, "merged file has no 'params' mapping")
    params = learned_names(model)
    constants = {n: b for n, b in model.named_buffers() if not _is_carried(n)}
    chosen: dict[int, str] = {}     # id(parameter) -> the file's name for it
    for name, tensor in given.items():
        if not isinstance(name, str) or _is_carried(name):
            raise MergeRefused(entry.round, f"merged file holds {name!r}: carried state, one "
                                            f"GPU's stream, is never merged")
        target = params.get(name, constants.get(name))
        if target is None:
            raise MergeRefused(entry.round, f"merged file holds {name!r}, not a parameter of "
                                            f"this model"[:200])
        if (type(tensor) is not torch.Tensor or tensor.layout != torch.strided
                or not tensor.is_floating_point()):
            kind = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise MergeRefused(entry.round, f"merged {name} is {kind}, not a dense floating "
                                            f"tensor")
        if tensor.shape != target.shape:
            raise MergeRefused(entry.round, f"merged {name} has shape {tuple(tensor.shape)}, "
                                            f"the model's is {tuple(target.shape)}")
        if name in params:
            chosen.setdefault(id(params[name]), name)
    missing = sorted({n for n, p in params.items() if id(p) not in chosen})
    if missing:
        raise MergeRefused(entry.round, f"merged file lacks {len(missing)} parameter(s): "
                                        f"{', '.join(missing[:3])}"[:300])
    if not all_finite(given):
        raise MergeRefused(entry.round, "merged file holds NaN or Inf")
    return {name: given[name] for name in chosen.values()}


def adopt(model: torch.nn.Module, params: dict) -> None:
    """Copy `params` (read_merged's) into the model's parameters in place: the same tensor
    objects and storage, so optimizer state and compiled guards stay valid."""
    own = learned_names(model)
    with torch.no_grad():
        for name, tensor in params.items():
            own[name].data.copy_(tensor)
