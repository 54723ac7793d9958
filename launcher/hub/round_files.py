"""The merge rounds' files on the hub: every push carries the pod's round state with the
checkpoints (one commit), and a pod rebuilt from a revision gets it back byte-exact and
consistent, or refuses it in one line having written nothing. Owner: the hub sync
(snapshot.py decides what a push holds, from_hub.py and pull.py restore); the files
themselves are the round orchestration's (launcher/supervise/merge_rounds.py).

What goes up (when `merge/rounds.json` exists and reads as a ledger): the ledger, the
workers' inbox, the outer state, and the merged round file of the ledger's newest adopted
round. Never the candidate outer state (`merge/outer_state.next.pt`): a round not yet
committed. A push takes hard links (each file is replaced atomically, never rewritten), so
what it sends is one moment's files; the stores keep one object per content (file:// by
sha256, hf:// by LFS oid), so an unchanged outer state is not stored twice.

What comes back is checked before anything is installed: each file's bytes against the hub
index (the store's `fetched`), the ledger as data (its format, round numbers in range, its
paths inside `merge/`: no absolute path, no '..'), the merged file's sha256 against the
ledger's `merged_sha256`, the inbox naming only that file, and the outer state as a weights-
only load of the newest adopted round's (launcher/hub/outer_step.py's `read_outer_state`).
Installed by rename from the scratch folder it was verified in, the ledger last.
"""

from __future__ import annotations

import json
import os
import re
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from launcher.errors import UserError
from launcher.files import fsync_dir
from launcher.paths import (MERGE_DIR, MERGE_INBOX_FILE, OUTER_STATE_FILE,
                            OUTER_STATE_PENDING, ROUNDS_LEDGER)
from launcher.pod.rounds_ledger import MAX_ROUND, parse_ledger
from launcher.pod.rounds_ledger import newest_adopted as newest_adopted_round

from .integrity import confine, pod_relpath

MAX_INBOX_BYTES = 64 << 10
ROUND_FILE = re.compile(r"^merge/round_(\d{5,10})\.pt$")
# Install order: the ledger last (it names the others).
_ORDER = (OUTER_STATE_FILE, MERGE_INBOX_FILE, ROUNDS_LEDGER)


class RoundsRefused(UserError):
    """Round state from the hub that does not verify: one line, nothing installed."""


@dataclass(frozen=True)
class Adopted:
    """The ledger's newest adopted round: its number and merged file."""
    round: int
    merged: str
    merged_sha256: str | None


def _round_number(value, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_ROUND:
        raise ValueError(f"{where}: round {value!r} is not an integer in 1..{MAX_ROUND}")
    return value


def merge_relpath(value, where: str) -> str:
    """A path of the ledger or inbox: pod-relative, inside merge/, none of the round state's
    own files. ValueError otherwise."""
    try:
        rel = pod_relpath(value) if isinstance(value, str) else None
    except ValueError:
        rel = None
    if rel is None or not rel.startswith(MERGE_DIR) or \
            rel in (ROUNDS_LEDGER, MERGE_INBOX_FILE, OUTER_STATE_FILE, OUTER_STATE_PENDING):
        raise ValueError(f"{where}: {value!r} is not a round file inside {MERGE_DIR}")
    return rel


def _json_mapping(raw: bytes, name: str, limit: int) -> dict:
    if len(raw) > limit:
        raise ValueError(f"{name} is over {limit} bytes")
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise ValueError(f"{name} is not JSON") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{name} is not a mapping")
    return doc


def newest_adopted(raw: bytes) -> Adopted | None:
    """The ledger's newest adopted round (None: none yet), the whole ledger checked
    (launcher/pod/rounds_ledger.py: its paths inside the pod, merged the round's own file);
    ValueError in one line."""
    entry = newest_adopted_round(parse_ledger(raw))
    return None if entry is None else Adopted(entry["round"], entry["merged"],
                                              entry["merged_sha256"])


def inbox_path(raw: bytes) -> str | None:
    """The merged file the inbox names (None: a refused round's); ValueError in one line."""
    doc = _json_mapping(raw, MERGE_INBOX_FILE, MAX_INBOX_BYTES)
    _round_number(doc.get("round"), MERGE_INBOX_FILE)
    path = doc.get("path")
    return None if path is None else merge_relpath(path, f"{MERGE_INBOX_FILE} path")


# ---- what a push carries -----------------------------------------------------------------
def round_files(pod_dir: Path) -> dict[str, Path]:
    """Pod-relative path -> file of the round state a push carries now ({}: no ledger, or
    one that does not read: nothing of it goes up, the hub keeps its last good state)."""
    ledger = pod_dir / ROUNDS_LEDGER
    try:
        adopted = newest_adopted(ledger.read_bytes())
    except (OSError, ValueError):         # none, or not a ledger
        return {}
    names = [ROUNDS_LEDGER, MERGE_INBOX_FILE, OUTER_STATE_FILE]
    if adopted is not None:
        names.append(adopted.merged)
    return {rel: pod_dir / rel for rel in names
            if (pod_dir / rel).is_file() and not (pod_dir / rel).is_symlink()}


def index_round(paths) -> int:
    """The newest merged round file among a hub index's paths (0: none): the round that
    revision's push carried."""
    found = [int(m.group(1)) for p in paths if (m := ROUND_FILE.match(p))]
    return max(found, default=0)


# ---- what a rebuilt pod gets back --------------------------------------------------------
@dataclass
class FetchedRounds:
    """Round files of one revision, verified in scratch; `install()` moves them in."""
    pod_dir: Path
    staged: dict[str, Path] = field(default_factory=dict)   # pod path -> verified file

    def install(self) -> list[str]:
        """Atomic renames into the pod (each its own, the ledger last); the paths."""
        order = sorted(self.staged, key=lambda rel: _ORDER.index(rel) if rel in _ORDER else -1)
        for rel in order:
            dest = confine(self.pod_dir, rel)
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(self.staged[rel], dest)
            fsync_dir(dest.parent)
        return order


@contextmanager
def fetched_rounds(store, revision: str, tracked: dict) -> Iterator[FetchedRounds]:
    """The round state revision `revision` (a full id; `tracked`: its index) holds, fetched
    and verified (module docstring); empty when it holds no ledger. RoundsRefused."""
    out = FetchedRounds(store.pod_dir)
    if ROUNDS_LEDGER not in tracked:
        yield out
        return

    def refuse(why: str):
        return RoundsRefused(f"revision {revision[:12]} of {store.url}: its merge round "
                             f"state does not verify ({why}); refused, nothing restored")

    with ExitStack() as stack:
        def fetch(rel: str) -> Path:
            try:
                out.staged[rel] = stack.enter_context(store.fetched(rel, revision))
            except Exception as exc:           # IntegrityError, HubError, OSError
                raise refuse(f"{rel}: {exc}") from None
            return out.staged[rel]

        try:
            adopted = newest_adopted(fetch(ROUNDS_LEDGER).read_bytes())
            if MERGE_INBOX_FILE in tracked:
                named = inbox_path(fetch(MERGE_INBOX_FILE).read_bytes())
                if named is not None and (adopted is None or named != adopted.merged):
                    raise ValueError(f"{MERGE_INBOX_FILE} names {named}, not the newest "
                                     f"adopted round's merged file")
        except ValueError as exc:
            raise refuse(str(exc)) from None
        if adopted is None:
            if OUTER_STATE_FILE in tracked:
                raise refuse(f"{OUTER_STATE_FILE} is held but the ledger adopted no round")
        else:
            for rel in (adopted.merged, OUTER_STATE_FILE):
                if rel not in tracked:
                    raise refuse(f"round {adopted.round} is adopted but {rel} is not held")
            held = tracked[adopted.merged].sha256
            if adopted.merged_sha256 is not None and held != adopted.merged_sha256:
                raise refuse(f"{adopted.merged} has sha256 {held[:12]}..., the ledger records "
                             f"{adopted.merged_sha256[:12]}...")
            fetch(adopted.merged)
            _check_outer_state(fetch(OUTER_STATE_FILE), adopted.round, refuse)
        yield out


def _check_outer_state(path: Path, round_n: int, refuse) -> None:
    from launcher.hub.outer_step import read_outer_state   # torch (~2 s): only when held

    try:
        read_outer_state(path, expect_round=round_n)
    except Exception as exc:          # ValueError, CheckpointLoadError, a torch error
        raise refuse(f"{OUTER_STATE_FILE}: {str(exc).splitlines()[0] if str(exc) else exc!r}"
                     ) from None
