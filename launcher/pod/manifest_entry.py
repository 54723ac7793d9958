"""One GPU's entry of the resume manifest, typed: checked once when read, changed only through
the named operations below. The user's own fields stay verbatim in `foreign`; `recorded` keeps
the keys in order (as read, then added), so an older-layout entry keeps the user's order and a
null stays null.
"""

from __future__ import annotations

import copy
import math
import re
import time
from dataclasses import dataclass, field

# The per-GPU fields this launcher maintains, in the order they are written.
ENTRY_FIELDS = ("start_token", "checkpoint", "checkpoint_sha256", "shard", "phase", "stage",
                "ema_tf", "lb", "updated_at", "hub_revision")
# Foreign progress fields that mean the same as start_token: kept equal to it at every write.
SAME_AS_START_TOKEN = ("tokens_processed",)
# The fields that describe the checkpoint an entry resumes from (gone for a fresh start).
CHECKPOINT_FIELDS = ("checkpoint", "checkpoint_sha256", "ema_tf", "lb", "hub_revision")


def _is_number(value) -> bool:
    # Finite: JSON has no NaN or Infinity, but 1e400 parses as inf.
    return isinstance(value, (int, float)) and not isinstance(value, bool) and \
        math.isfinite(value)


# What each field must hold when present (null allowed where a GPU may not have it yet).
_FIELD_TYPES = {
    "checkpoint": ("a path string", lambda v: isinstance(v, str) and bool(v)),
    "checkpoint_sha256": ("a 64-digit hex sha256",
                          lambda v: isinstance(v, str) and re.fullmatch(r"[0-9a-f]{64}", v)),
    "shard": ("a path string", lambda v: isinstance(v, str) and bool(v)),
    "stage": ("an integer >= 1", lambda v: isinstance(v, int) and not isinstance(v, bool)
              and v >= 1),
    "phase": ("an integer from 1 to 1000", lambda v: isinstance(v, int)
              and not isinstance(v, bool) and 1 <= v <= 1000),
    "ema_tf": ("a number", _is_number),
    "lb": ("a number", _is_number),
    "updated_at": ("a number (unix time)", _is_number),
    "hub_revision": ("a revision string", lambda v: isinstance(v, str) and bool(v)),
}


class EntryError(ValueError):
    """A field of the wrong type; the manifest reader names the file and the fix."""


@dataclass
class ManifestEntry:
    start_token: int = 0
    checkpoint: str | None = None           # relative to the pod (or absolute inside it)
    checkpoint_sha256: str | None = None
    shard: str | None = None
    # The data phase start_token counts in; None (phase 1) until a switch, keeping the layout.
    phase: int | None = None
    stage: int | None = None                # the stage its checkpoint was trained at
    ema_tf: float | None = None
    lb: float | None = None
    updated_at: float | None = None
    hub_revision: str | None = None         # the hub commit holding the checkpoint's bytes
    foreign: dict = field(default_factory=dict)      # the user's own fields, verbatim
    recorded: list = field(default_factory=list)     # keys held, in order, nulls included

    def __post_init__(self):
        if not self.recorded:
            self.recorded = ["start_token", *self.foreign]

    # ---- read and write ------------------------------------------------------------------
    @classmethod
    def parse(cls, raw: dict, gpu: int) -> ManifestEntry:
        """The entry of a manifest's JSON object; EntryError names the field and the fix."""
        if "start_token" not in raw:
            raise EntryError(f"gpu_{gpu} has no start_token")
        token = raw["start_token"]
        if isinstance(token, bool) or not isinstance(token, int):
            raise EntryError(f"gpu_{gpu} start_token must be an integer, got {token!r}")
        if token < 0:
            raise EntryError(f"gpu_{gpu} start_token is negative ({token})")
        for name, (wanted, ok) in _FIELD_TYPES.items():
            value = raw.get(name)
            if value is not None and not ok(value):
                raise EntryError(f"gpu_{gpu} {name} must be {wanted}, got {value!r}; fix or "
                                 f"remove that field")
        return cls(**{k: v for k, v in raw.items() if k in ENTRY_FIELDS},
                   foreign={k: v for k, v in raw.items() if k not in ENTRY_FIELDS},
                   recorded=list(raw))

    def to_json(self, layout: str) -> dict:
        """As written: ours first in the current layout, the user's order in the older one."""
        ours = [n for n in ENTRY_FIELDS if n in self]
        if layout == "older":
            order = [k for k in self.recorded if k in self]
            order += [n for n in ours if n not in order]
        else:
            order = ours + [k for k in self.recorded if k in self.foreign]
        out = {k: self[k] for k in order}
        for name in SAME_AS_START_TOKEN:
            if name in out:
                out[name] = self.start_token
        return out

    def copy(self) -> ManifestEntry:
        return copy.deepcopy(self)

    # ---- the entry as its JSON reader sees it (by the manifest's field names) ------------
    def __contains__(self, name: str) -> bool:
        if name in ENTRY_FIELDS:
            return getattr(self, name) is not None or name in self.recorded
        return name in self.foreign

    def __getitem__(self, name: str):
        if name not in self:
            raise KeyError(name)
        return getattr(self, name) if name in ENTRY_FIELDS else self.foreign[name]

    def __setitem__(self, name: str, value) -> None:
        if name in ENTRY_FIELDS:
            setattr(self, name, value)
        else:
            self.foreign[name] = value
        if name not in self.recorded:
            self.recorded.append(name)

    def _forget(self, name: str) -> None:
        setattr(self, name, None)
        if name in self.recorded:
            self.recorded.remove(name)

    # ---- progress: where the GPU is, in (phase, token) order ------------------------------
    @property
    def at_phase(self) -> int:
        """The data phase start_token counts in (1 when none is recorded)."""
        return self.phase or 1

    @property
    def position(self) -> tuple[int, int]:
        """(phase, start_token): progress compares in this order, never by token alone."""
        return self.at_phase, self.start_token

    @property
    def at_phase_start(self) -> bool:
        """At token 0 of phase N > 1: its checkpoint ended phase N-1 (ema_tf, lb of other data)."""
        return self.at_phase > 1 and self.start_token == 0

    # ---- the operations that change an entry ---------------------------------------------
    def advance(self, next_token: int, checkpoint: str, sha256: str | None, shard: str,
                stage: int, ema_tf: float | None, lb: float | None,
                phase: int = 1) -> None:
        """To a checkpoint a worker wrote in `phase` (the caller refuses going backwards)."""
        self._forget_hub_revision_unless(sha256)
        for name, value in (("start_token", next_token), ("checkpoint", checkpoint),
                            ("checkpoint_sha256", sha256), ("shard", shard), ("stage", stage),
                            ("ema_tf", ema_tf), ("lb", lb), ("updated_at", time.time())):
            self[name] = value
        self._note_phase(phase)

    def switch_phase(self, phase: int, shard: str) -> None:
        """To token 0 of `phase`'s `shard`, from the checkpoint it names (all state continues)."""
        for name, value in (("start_token", 0), ("shard", shard), ("phase", phase),
                            ("updated_at", time.time())):
            self[name] = value

    def roll_back(self, target: dict, stage: int) -> None:
        """To checkpoint-index record `target`; the shard is dropped if `target` is of another
        data phase (the config's shard of that phase applies)."""
        self._forget_hub_revision_unless(target["sha256"])
        for name, value in (("start_token", int(target["next_token"])),
                            ("checkpoint", target["path"]),
                            ("checkpoint_sha256", target["sha256"]), ("stage", stage),
                            ("ema_tf", target.get("ema_tf")), ("lb", target.get("lb")),
                            ("updated_at", time.time())):
            self[name] = value
        phase = int(target.get("phase") or 1)
        if phase != self.at_phase:
            self._forget("shard")
        self._note_phase(phase)

    def _note_phase(self, phase: int) -> None:
        """Record `phase` once it is past 1, or when the entry already records one."""
        if phase != 1 or self.phase is not None:
            self["phase"] = phase

    def start_over(self) -> None:
        """Back to token 0 with no checkpoint: nothing the GPU wrote is left to resume from."""
        for name in CHECKPOINT_FIELDS:
            self._forget(name)
        self["start_token"] = 0
        self["updated_at"] = time.time()

    def note_hub_revision(self, revision: str) -> None:
        self["hub_revision"] = revision

    def set_stage(self, stage: int) -> None:
        self["stage"] = stage

    def name_checkpoint(self, name: str) -> None:
        """The file it resumes from; its recorded sha256 is unchanged."""
        self["checkpoint"] = name

    def as_pushed(self, record: dict, hub_path: str, shard: str) -> ManifestEntry:
        """The entry the hub gets with passed checkpoint `record` pushed at `hub_path` (`shard`:
        that of the record's phase). No hub_revision (a manifest cannot know its own commit);
        the stage is the entry's (a rollback may have lowered it), the record's only if none;
        a phase switch from this very checkpoint is pushed as the switch."""
        pushed = self.copy()
        pushed._forget("hub_revision")
        if record["sha256"] == self.checkpoint_sha256 and self.at_phase > 1 and \
                self.start_token == 0:
            position = {"start_token": 0, "shard": self.shard or shard, "phase": self.phase}
        else:
            phase = int(record.get("phase") or 1)
            same_phase = phase == self.at_phase
            position = {"start_token": int(record["next_token"]),
                        "shard": (self.shard if same_phase else None) or shard,
                        "phase": phase if (phase > 1 or self.phase is not None) else None}
        for name, value in (("start_token", position["start_token"]),
                            ("checkpoint", hub_path), ("checkpoint_sha256", record["sha256"]),
                            ("shard", position["shard"]),
                            ("stage", self.stage if self.stage is not None
                                       else record.get("stage")),
                            ("ema_tf", record.get("ema_tf")), ("lb", record.get("lb")),
                            ("updated_at", record.get("ts", self.updated_at))):
            pushed[name] = value
        if position["phase"] is not None:
            pushed["phase"] = position["phase"]
        return pushed

    def _forget_hub_revision_unless(self, new_sha256: str | None) -> None:
        """Drop hub_revision once the entry names other bytes (it would restore the wrong file)."""
        if self.checkpoint_sha256 != new_sha256:
            self._forget("hub_revision")
