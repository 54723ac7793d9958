"""Mean-merge of the GPUs' checkpoints into one legacy-format "brain": floating tensors
averaged, integer/bool tensors and `config` from the first, carried-state buffers dropped
(one process's stream, not the model; their batch dimension differs between GPUs). Tied
tensors stay shared.

Memory: checkpoints are mmap-loaded one after another, so the process holds the float32 (or
wider) sums plus the one being read: about two checkpoints, whatever the number of GPUs.
`stream_mean` is that mean on its own, weighted if asked (merge rounds: outer_step.py). A NaN/Inf tensor is refused (NotFinite, nothing written); `verify` refuses a checkpoint
that is not the GPU's own (launcher.pod.ckpt_trust)."""

from __future__ import annotations

import math
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager, Sequence

import torch

from fractus.legacy import read_checkpoint
from launcher.files import atomic_write_with
from launcher.pod.progress import progress

CARRIED_STATE_SUFFIXES = ("attn_S", "attn_z", "kuramoto_phases")
CARRIED_STATE_NAMES = ("thought_state", "last_lb_loss")


def is_carried_state(key: str) -> bool:
    """True for buffers that hold one process's running state (keys may carry `_orig_mod.`)."""
    last = key.rsplit(".", 1)[-1]
    if last in CARRIED_STATE_NAMES:
        return True
    return "." in key and last in CARRIED_STATE_SUFFIXES


@dataclass(frozen=True)
class MergeReport:
    out_path: Path
    n_checkpoints: int
    averaged: int  # floating tensors averaged
    copied: int  # integer/bool tensors taken from the first checkpoint
    dropped: tuple[str, ...]  # carried-state keys left out


class NotFinite(ValueError):
    """A checkpoint tensor holds NaN or Inf."""


def _refuse_non_finite(path, key: str, t: torch.Tensor) -> None:
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        raise NotFinite(f"{_name(path)}: {key} holds NaN or Inf; a mean with it is no brain: "
                        f"roll that GPU back to a passed checkpoint, then merge")


def _load(path: Path) -> tuple[dict, dict]:
    ckpt = read_checkpoint(path, mmap=True)     # CheckpointLoadError: one line, a ValueError
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("model_state"), dict):
        raise ValueError(f"{path} is not a legacy checkpoint with a 'model_state' dict")
    return ckpt["model_state"], ckpt.get("config", {})


def _storage_key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def _accumulator(t: torch.Tensor) -> torch.Tensor:
    """A fresh float32 (or float64) copy of `t` to sum into."""
    wide = torch.float64 if t.dtype == torch.float64 else torch.float32
    return t.to(dtype=wide, copy=True)


def on_disk(source) -> ContextManager[Path]:
    """A merge source that is a file here: itself."""
    return nullcontext(Path(source))


def merge_checkpoints(sources: Sequence, out_path: str | Path,
                      fetch: Callable[[Any], ContextManager[Path]] = on_disk,
                      verify: Callable[[Any, Path], None] | None = None) -> MergeReport:
    """Merge `sources` into `out_path` (atomic). `fetch(source)` makes a source a file while
    it is read (a hub checkpoint: one at a time); `verify(source, file)` raises to refuse."""
    if not sources:
        raise ValueError("merge needs at least one checkpoint")
    with progress(f"merging {len(sources)} checkpoints", len(sources), "checkpoints") as task:
        return _merge(list(sources), Path(out_path), _verified(fetch, verify), task)


def _verified(fetch, verify):
    if verify is None:
        return fetch

    @contextmanager
    def checked(source):
        with fetch(source) as local:
            verify(source, Path(local))
            yield local
    return checked


def _name(source) -> str:
    return Path(str(source)).name


def _merge(paths: list, out_path: Path, fetch, task) -> MergeReport:
    streamed = _stream(paths, fetch, task, None)
    task.update(description=f"merging: writing {out_path.name}")
    merged = dict(streamed.kept)
    for key in list(streamed.means):
        acc, dtype = streamed.means.pop(key), streamed.spec[key][1]
        merged[key] = acc if acc.dtype == dtype else acc.to(dtype)
    spec, aliases = streamed.spec, streamed.aliases
    # Rebuild the first checkpoint's key order, tied keys pointing at the same tensor.
    model_state = {}
    for key in spec:
        model_state[key] = merged[aliases.get(key, key)]

    atomic_write_with(out_path, lambda f: torch.save(
        {"model_state": model_state, "config": dict(streamed.config)}, f))
    n = len(paths)
    n_float = sum(1 for k in spec if k not in aliases and spec[k][1].is_floating_point)
    return MergeReport(out_path, n, n_float, len(spec) - len(aliases) - n_float,
                       streamed.dropped)


@dataclass
class StreamedMean:
    """The sources' floating tensors averaged, read one checkpoint at a time."""
    means: dict[str, torch.Tensor]  # untied floating keys -> mean, float32 (float64 if wider)
    kept: dict[str, torch.Tensor]  # untied integer/bool keys -> the first checkpoint's
    aliases: dict[str, str]  # key -> earlier key sharing its storage (tied weights)
    spec: dict[str, tuple]  # every key but carried state -> (shape, dtype), first's order
    config: dict  # the first checkpoint's
    dropped: tuple[str, ...]  # carried-state keys left out


def stream_mean(sources: Sequence, weights: Sequence[float] | None = None,
                fetch: Callable[[Any], ContextManager[Path]] = on_disk,
                verify: Callable[[Any, Path], None] | None = None) -> StreamedMean:
    """The (weighted: `weights`, one non-negative number per source, not all zero; None:
    equal) mean of `sources`' floating tensors, as `merge_checkpoints` streams it."""
    if not sources:
        raise ValueError("merge needs at least one checkpoint")
    with progress(f"averaging {len(sources)} checkpoints", len(sources), "checkpoints") as task:
        return _stream(list(sources), _verified(fetch, verify), task, weights)


def _scaled_weights(weights, n: int) -> list[float] | None:
    """The weights over their largest (equal weights: all 1.0, the plain sum); None: equal."""
    if weights is None:
        return None
    weights = list(weights)
    if len(weights) != n:
        raise ValueError(f"{len(weights)} merge weights for {n} checkpoints")
    for w in weights:
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) \
                or w < 0:
            raise ValueError(f"merge weight {w!r} is not a finite number >= 0")
    top = max(weights)
    if top == 0:
        raise ValueError("merge weights are all zero: no checkpoint to average")
    return [w / top for w in weights]


def _stream(paths: list, fetch, task, weights) -> StreamedMean:
    scaled = _scaled_weights(weights, len(paths))
    task.update(description=f"merging: reading {_name(paths[0])}")
    with fetch(paths[0]) as local:
        first_state, config = _load(local)
        merged_first = _start_sums(paths[0], first_state, 1.0 if scaled is None else scaled[0])
        del first_state
    sums, merged, aliases, spec, dropped = merged_first
    task.update(advance=1)

    for i, path in enumerate(paths[1:], 1):
        task.update(description=f"merging: adding {_name(path)}")
        with fetch(path) as local:
            state, _ = _load(local)
            _add(path, paths[0], state, sums, spec, 1.0 if scaled is None else scaled[i])
            del state
        task.update(advance=1)

    total = len(paths) if scaled is None else math.fsum(scaled)
    for acc in sums.values():
        acc.div_(total)
    return StreamedMean(sums, merged, aliases, spec, dict(config), dropped)


def _start_sums(path, first_state: dict, weight: float = 1.0) -> tuple:
    """Sums (own copies: the file may go once read), kept tensors, tied keys and the spec."""
    dropped = tuple(k for k in first_state if is_carried_state(k))
    sums: dict[str, torch.Tensor] = {}  # floating keys -> running sum
    merged: dict[str, torch.Tensor] = {}  # every kept key, in the first checkpoint's order
    aliases: dict[str, str] = {}  # key -> earlier key sharing its storage (tied weights)
    spec: dict[str, tuple] = {}  # key -> (shape, dtype) every checkpoint must match
    seen_storage: dict[tuple, str] = {}
    for key, t in first_state.items():
        if key in dropped:
            continue
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{path}: model_state[{key!r}] is not a tensor")
        spec[key] = (tuple(t.shape), t.dtype)
        skey = _storage_key(t)
        if skey in seen_storage:
            aliases[key] = seen_storage[skey]
            continue
        seen_storage[skey] = key
        if t.is_floating_point():
            _refuse_non_finite(path, key, t)
            sums[key] = _accumulator(t)
            if weight != 1.0:
                sums[key].mul_(weight)
        else:
            merged[key] = t.clone()  # own the bytes: the mmap is released below
    return sums, merged, aliases, spec, dropped


def _add(path, first, state: dict, sums: dict, spec: dict, weight: float = 1.0) -> None:
    kept = {k for k in state if not is_carried_state(k)}
    if kept != set(spec):
        extra, missing = sorted(kept - set(spec)), sorted(set(spec) - kept)
        raise ValueError(f"{path} does not match {first}: extra keys {extra[:5]}, "
                         f"missing {missing[:5]}")
    for key, acc in sums.items():
        t = state[key]
        if (tuple(t.shape), t.dtype) != spec[key]:
            raise ValueError(
                f"{path}: {key} is {tuple(t.shape)} {t.dtype}, expected {spec[key][0]} {spec[key][1]}"
            )
        _refuse_non_finite(path, key, t)
        if weight == 1.0:
            acc.add_(t)  # pages this tensor in, adds, and never touches it again
        elif weight:
            acc.add_(t, alpha=weight)
