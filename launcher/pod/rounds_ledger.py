"""The merge rounds' ledger, `merge/rounds.json`, read and checked in one place: every field
has a type and a range, every path stays inside the pod (checkpoints) or is the round's own
file (merged), or the whole file is refused (LedgerError, one line). It is data: nothing in
it is run. Written only by launcher/supervise/merge_rounds.py (MergeRounds, its owner); read
by it, by `status` (launcher/dashboard/merge_status.py) and by the hub's round files
(launcher/hub/round_files.py).

    {"format": "fractus-pod-rounds-v1",
     "origins": {"<stage>": {"<gpu>": token}},      where each GPU's boundaries count from
     "rounds": [{"round": n (the n-th record), "stage", "boundary" (k >= 1; null: a stage's
                 end), "state": merging | adopted | refused,
                 "gpus": {"<gpu>": {"at_token", "checkpoint", "sha256", "tokens"}},
                 "left_out": [gpu], "weights": [float], "outer": {...},
                 "merged": "merge/round_0000n.pt" | null, "merged_sha256": hex | null,
                 "gate": {...} | null, "reason": str, "seconds": float | null, ...}]}
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path, PurePosixPath

from launcher.paths import ROUNDS_LEDGER, merged_round_path

LEDGER_FORMAT = "fractus-pod-rounds-v1"
STATES = ("merging", "adopted", "refused")
MAX_ROUND = 10**9
MAX_GPU = 4096
MAX_STAGE = 1000
MAX_TOKEN = 10**18
MAX_LEDGER_BYTES = 64 << 20
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class LedgerError(ValueError):
    """merge/rounds.json is not a ledger this version reads (the message is one line)."""


def fresh_ledger() -> dict:
    return {"format": LEDGER_FORMAT, "origins": {}, "rounds": []}


def _int(value, low: int, high: int, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise LedgerError(f"{where} {value!r} is not an integer in {low}..{high}")
    return value


def _key(key, high: int, where: str) -> int:
    if not isinstance(key, str) or not key.isdigit() or len(key) > 12:
        raise LedgerError(f"{where} key {key!r} is not a number")
    return _int(int(key), 0, high, where)


def _sha(value, where: str, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str) or not _SHA256.match(value):
        raise LedgerError(f"{where} {value!r} is not a sha256")


def _checkpoint(value, where: str) -> None:
    """A pod-relative path: no absolute path, no '..'."""
    path = PurePosixPath(value) if isinstance(value, str) and value else None
    if path is None or path.is_absolute() or ".." in path.parts or "\\" in value:
        raise LedgerError(f"{where} {value!r} is not a path inside the pod")


def _round(entry, n: int) -> None:
    where = f"{ROUNDS_LEDGER} round {n}"
    if not isinstance(entry, dict) or entry.get("round") != n:
        raise LedgerError(f"{where}: not the record of round {n}")
    if entry.get("state") not in STATES:
        raise LedgerError(f"{where}: state {entry.get('state')!r} is not one of "
                          f"{', '.join(STATES)}")
    _int(entry.get("stage"), 1, MAX_STAGE, f"{where}: stage")
    if entry.get("boundary") is not None:
        _int(entry["boundary"], 1, MAX_ROUND, f"{where}: boundary")
    gpus, left_out = entry.get("gpus"), entry.get("left_out", [])
    if not isinstance(gpus, dict) or not isinstance(left_out, list):
        raise LedgerError(f"{where}: gpus is not a mapping or left_out not a list")
    for gpu, record in gpus.items():
        at = f"{where}: gpu {gpu}"
        _key(gpu, MAX_GPU, at)
        if not isinstance(record, dict):
            raise LedgerError(f"{at} is not a mapping")
        _int(record.get("at_token"), 0, MAX_TOKEN, f"{at} at_token")
        _int(record.get("tokens", 0), -MAX_TOKEN, MAX_TOKEN, f"{at} tokens")
        _checkpoint(record.get("checkpoint"), f"{at} checkpoint")
        _sha(record.get("sha256"), f"{at} sha256")
    for gpu in left_out:
        _int(gpu, 0, MAX_GPU, f"{where}: left_out")
    weights = entry.get("weights", [])
    if not isinstance(weights, list) or not all(
            isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w)
            and w >= 0 for w in weights):
        raise LedgerError(f"{where}: weights are not finite numbers >= 0")
    merged = entry.get("merged")
    if merged is not None and merged != merged_round_path(n):
        raise LedgerError(f"{where}: merged {merged!r} is not a round file inside merge/ "
                          f"(round {n}'s is {merged_round_path(n)})")
    if entry["state"] == "adopted" and merged is None:
        raise LedgerError(f"{where}: adopted, with no merged file")
    _sha(entry.get("merged_sha256"), f"{where}: merged_sha256", optional=True)


def check_ledger(data) -> dict:
    """`data` (the parsed JSON) if it is a whole, consistent ledger; LedgerError otherwise."""
    if not isinstance(data, dict) or data.get("format") != LEDGER_FORMAT:
        raise LedgerError(f"{ROUNDS_LEDGER} is not a {LEDGER_FORMAT} ledger")
    origins, rounds = data.get("origins"), data.get("rounds")
    if not isinstance(origins, dict) or not isinstance(rounds, list):
        raise LedgerError(f"{ROUNDS_LEDGER}: origins is not a mapping or rounds not a list")
    for stage, per_gpu in origins.items():
        where = f"{ROUNDS_LEDGER} origins[{stage!r}]"
        _key(stage, MAX_STAGE, where)
        if not isinstance(per_gpu, dict):
            raise LedgerError(f"{where} is not a mapping")
        for gpu, token in per_gpu.items():
            _key(gpu, MAX_GPU, where)
            _int(token, 0, MAX_TOKEN, f"{where}[{gpu!r}]")
    for n, entry in enumerate(rounds, 1):
        _round(entry, n)
    return data


def parse_ledger(raw: bytes) -> dict:
    """The ledger from its bytes, checked; LedgerError otherwise."""
    if len(raw) > MAX_LEDGER_BYTES:
        raise LedgerError(f"{ROUNDS_LEDGER} is over {MAX_LEDGER_BYTES >> 20} MiB")
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise LedgerError(f"{ROUNDS_LEDGER} is not JSON: {exc}"[:300]) from None
    return check_ledger(data)


def read_ledger(pod_dir: Path) -> dict | None:
    """The pod's ledger, checked; None when there is none; LedgerError otherwise."""
    path = pod_dir / ROUNDS_LEDGER
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_LEDGER_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise LedgerError(f"{ROUNDS_LEDGER} cannot be read: {exc}") from None
    return parse_ledger(raw)


def newest_adopted(ledger: dict) -> dict | None:
    """The newest adopted round's record, None before any."""
    return next((e for e in reversed(ledger["rounds"]) if e["state"] == "adopted"), None)
