"""A merge round is a pure function of its inputs (the quorum GPUs' checkpoints, their
weights, the outer settings and round n-1's outer state): run again, it writes the same
bytes; NaN/Inf anywhere is refused (NotFinite) and a refused round writes nothing. Owner: the
launcher; the supervisor's round orchestration calls it. The weighted mean of the GPUs'
parameters is merge.py's `stream_mean` (one checkpoint mmapped at a time: memory flat in the
number of GPUs, at peak about six float32 copies of the parameters, the mmapped old outer
state and checkpoint being read included), then the outer step.

Per parameter, in float32 (float64 if the source is): g = outer - mean; m <- mu*m + g;
outer <- outer - lr*(g + mu*m) (`nesterov`); `mean` is lr 1, mu 0, where outer <- mean
exactly. Round 1 has no outer state: outer := mean, m := 0. Parameters are the floating
tensors of model_state but the carried state (merge.is_carried_state); tied ones stay tied.

Files (launcher/paths.py), torch files read with weights_only=True:
  merge/round_{n:05d}.pt   {"format": MERGED_FORMAT, "round": n, "params": {name: tensor}}
  merge/outer_state.pt     {"format": OUTER_FORMAT, "round": n, "outer": {...},
                            "momentum": {...}, "settings": OuterSettings.to_dict()}
The round file is written first, the outer state last: a crash between them leaves round
n-1's outer state, and the rerun writes the same round file again.

How the orchestration uses it: at a round, `outer_step(pod, n, checkpoints, settings,
weights, commit=False)` writes the round file and the candidate outer state
(OUTER_STATE_PENDING); the report's sha256 goes in the round's record and the workers'
inbox. Once the gate passes the round, `commit_outer_state(pod, n)` renames the candidate
over merge/outer_state.pt (the outer state's commit point); a refused round deletes the
candidate, and the outer state stays round n-1's. `commit=True` does both at once.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager, Sequence

import torch

from fractus.legacy import read_checkpoint
from launcher.config.merge_rounds_settings import OuterSettings
from launcher.files import atomic_write_with, fsync_dir, sha256_file
from launcher.hub.merge import NotFinite, StreamedMean, on_disk, stream_mean
from launcher.paths import OUTER_STATE_FILE, OUTER_STATE_PENDING, merged_round_path

OUTER_FORMAT = "fractus-pod-outer-v1"
MERGED_FORMAT = "fractus-pod-merged-v1"
_OUTER_KEYS = {"format", "round", "outer", "momentum", "settings"}


@dataclass(frozen=True)
class RoundReport:
    round: int
    n_gpus: int
    weights: tuple[float, ...]  # normalised: they sum to 1
    tensors: int  # parameter names merged (tied ones each counted)
    bytes_written: int  # the round file and the outer state
    sha256: str  # of the round file
    merged_path: Path
    outer_state_path: Path  # merge/outer_state.pt, or the candidate with commit=False
    committed: bool


@dataclass
class OuterState:
    round: int
    outer: dict[str, torch.Tensor]
    momentum: dict[str, torch.Tensor]
    settings: OuterSettings


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _is_round(n) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 1


def read_outer_state(path: str | Path, expect_round: int | None = None) -> OuterState:
    """The outer state file at `path` (mmapped), its format, round (== `expect_round` if
    given), settings and tensors checked; a one-line ValueError otherwise."""
    state = read_checkpoint(path, mmap=True)       # CheckpointLoadError: a ValueError
    if not isinstance(state, dict) or set(state) != _OUTER_KEYS \
            or state["format"] != OUTER_FORMAT:
        raise ValueError(f"{path} is not a {OUTER_FORMAT} outer state")
    n = state["round"]
    if not _is_round(n):
        raise ValueError(f"{path}: round {n!r} is not an integer >= 1")
    if expect_round is not None and n != expect_round:
        raise ValueError(f"{path} is round {n}'s outer state, expected round {expect_round}'s")
    for part in ("outer", "momentum"):
        tensors = state[part]
        if not isinstance(tensors, dict) or not all(
                isinstance(k, str) and isinstance(t, torch.Tensor) and t.is_floating_point()
                for k, t in tensors.items()):
            raise ValueError(f"{path}: {part} is not a dict of floating tensors")
    if set(state["outer"]) != set(state["momentum"]):
        raise ValueError(f"{path}: outer and momentum name different tensors")
    try:
        settings = OuterSettings.from_dict(state["settings"])
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    return OuterState(n, state["outer"], state["momentum"], settings)


def _check_matches(path, prior: OuterState, streamed: StreamedMean, names: list[str]) -> None:
    """`prior` names exactly `names`, each with the checkpoints' shape, tied where they are
    tied, finite."""
    if set(prior.outer) != set(names):
        extra, missing = sorted(set(prior.outer) - set(names)), sorted(set(names) - set(prior.outer))
        raise ValueError(f"{path} does not match the checkpoints: extra {extra[:5]}, "
                         f"missing {missing[:5]}")
    for part, tensors in (("outer", prior.outer), ("momentum", prior.momentum)):
        for key in names:
            t, (shape, dtype) = tensors[key], streamed.spec[key]
            if tuple(t.shape) != shape or t.dtype != _wide(dtype):
                raise ValueError(f"{path}: {part} {key} is {tuple(t.shape)} {t.dtype}, "
                                 f"expected {shape} {_wide(dtype)}")
            tied = streamed.aliases.get(key)
            if tied is not None:
                if not torch.equal(t, tensors[tied]):
                    raise ValueError(f"{path}: {part} {key} is not tied to {tied}")
            elif not bool(torch.isfinite(t).all()):
                raise NotFinite(f"{path}: {part} {key} holds NaN or Inf")


def _step(mean, outer, m, s: OuterSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """(new outer, new momentum) for one tensor."""
    g = outer.sub(mean)
    m = m.mul(s.momentum).add_(g)
    if s.lr == 1 and s.momentum == 0:
        return mean, m          # outer - (outer - mean) rounds; the corner is the mean itself
    return outer.sub(m.mul(s.momentum).add_(g).mul_(s.lr)), m


def _refuse_non_finite(n: int, part: str, key: str, t: torch.Tensor) -> None:
    if not bool(torch.isfinite(t).all()):
        raise NotFinite(f"round {n}: the new {part} of {key} holds NaN or Inf; nothing written")


def outer_step(pod_dir: str | Path, round_n: int, sources: Sequence, settings: OuterSettings,
               weights: Sequence[float] | None = None,
               fetch: Callable[[Any], ContextManager[Path]] = on_disk,
               verify: Callable[[Any, Path], None] | None = None,
               commit: bool = True, last_adopted: int | None = None) -> RoundReport:
    """Round `round_n` of the pod at `pod_dir` from the quorum's checkpoints `sources`
    (`fetch`/`verify` as merge_checkpoints), weighted by `weights` (None: equal; else one
    number >= 0 per source, e.g. the tokens each trained since the last round, not all 0).
    `last_adopted`: the round whose outer state this one steps from (0: none yet, the
    outer weights start at the mean; None: round_n - 1, every round adopted). Writes the
    round file, then the outer state (`commit=False`: the candidate)."""
    if not _is_round(round_n):
        raise ValueError(f"round {round_n!r} is not an integer >= 1")
    if not isinstance(settings, OuterSettings):
        raise ValueError("settings must be an OuterSettings")
    after = round_n - 1 if last_adopted is None else last_adopted
    if isinstance(after, bool) or not isinstance(after, int) or not 0 <= after < round_n:
        raise ValueError(f"last adopted round {last_adopted!r} is not in 0..{round_n - 1}")
    pod = Path(pod_dir)
    outer_path = pod / OUTER_STATE_FILE
    prior = None
    if after:
        if not outer_path.exists():
            raise ValueError(f"round {round_n} needs round {after}'s outer state; "
                             f"{outer_path} is missing")
        prior = read_outer_state(outer_path, expect_round=after)
    elif outer_path.exists():
        raise ValueError(f"round {round_n} is the first adopted, yet {outer_path} exists "
                         f"(round {read_outer_state(outer_path).round}'s)")

    streamed = stream_mean(sources, weights, fetch, verify)
    spec, aliases = streamed.spec, streamed.aliases
    names = [k for k in spec if spec[k][1].is_floating_point]
    if prior is not None:
        _check_matches(outer_path, prior, streamed, names)

    new_outer, new_m, params = {}, {}, {}
    for key in list(streamed.means):
        mean = streamed.means.pop(key)
        if prior is None:
            outer, m = mean, torch.zeros_like(mean)
        else:
            outer, m = _step(mean, prior.outer[key], prior.momentum[key], settings)
        _refuse_non_finite(round_n, "outer weights", key, outer)
        _refuse_non_finite(round_n, "momentum", key, m)
        new_outer[key], new_m[key] = outer, m
        dtype = spec[key][1]
        params[key] = outer if outer.dtype == dtype else outer.to(dtype)
    del prior
    # The checkpoints' key order, tied names pointing at one tensor.
    ordered = {part: {k: d[aliases.get(k, k)] for k in names}
               for part, d in (("outer", new_outer), ("momentum", new_m), ("params", params))}

    merged_path = pod / merged_round_path(round_n)
    atomic_write_with(merged_path, lambda f: torch.save(
        {"format": MERGED_FORMAT, "round": round_n, "params": ordered["params"]}, f))
    target = outer_path if commit else pod / OUTER_STATE_PENDING
    atomic_write_with(target, lambda f: torch.save(
        {"format": OUTER_FORMAT, "round": round_n, "outer": ordered["outer"],
         "momentum": ordered["momentum"], "settings": settings.to_dict()}, f))

    n = len(sources)
    raw = [1.0] * n if weights is None else [float(w) for w in weights]
    total = math.fsum(raw)
    return RoundReport(round_n, n, tuple(w / total for w in raw), len(names),
                       merged_path.stat().st_size + target.stat().st_size,
                       sha256_file(merged_path), merged_path, target, commit)


def commit_outer_state(pod_dir: str | Path, round_n: int) -> Path:
    """Make round `round_n`'s candidate outer state the pod's (an atomic rename); refused
    (ValueError, nothing changed) unless the candidate is that round's."""
    pod = Path(pod_dir)
    pending = pod / OUTER_STATE_PENDING
    if not pending.exists():
        raise ValueError(f"no candidate outer state to commit for round {round_n}: "
                         f"{pending} is missing")
    read_outer_state(pending, expect_round=round_n)
    target = pod / OUTER_STATE_FILE
    os.replace(pending, target)
    fsync_dir(target.parent)
    return target
