"""Loading the reference's legacy checkpoints: `{"model_state": state_dict, "config": {...}}`.

Keys may carry an `_orig_mod.` prefix (a compiled module's); carried buffers are restored
when their batch fits, else reset. Parameters load strictly; what construction computes
(constant buffers, a tied weight's second name) may be missing and is filled and named
(docs/ENGINE.md, "API").

Formats (`as_engine_checkpoint`): v1 `{"model_state", "config"}` (v1 TARGET keys, no
vocab_size: 50257, EngineConfig's default); the merged brain (same, no carried buffers);
fractus-pod's (plus train_state, optimizer_state); a bare state_dict or config-less
`{"model_state"}`, built with the caller's `config` (the reference: its TARGET config).
"""

from __future__ import annotations

import os
import pickle
import re
import warnings
import zipfile

import torch

from .config import EngineConfig

COMPILED_PREFIX = "_orig_mod."
# torch.save stores zip records uncompressed; only a foreign or hostile file deflates one.
# A cap, so a small file cannot inflate a record to gigabytes in the pre-start check.
MAX_INFLATED_RECORD = 64 << 20


class CheckpointLoadError(ValueError):
    """A file that does not load: one line naming it, never advising an unsafe load."""


def read_checkpoint(source, map_location="cpu", mmap: bool = False) -> dict:
    """A checkpoint dict from a path or dict; never unpickles code; CheckpointLoadError if
    it does not load. `mmap=True` maps tensors (torch's pre-zip format is read whole)."""
    if isinstance(source, dict):
        return source
    if not isinstance(source, (str, os.PathLike)):
        raise ValueError(f"expected a checkpoint path or dict, got {type(source).__name__}")
    check_zip_directory(source)
    try:
        try:
            return torch.load(source, map_location=map_location, weights_only=True, mmap=mmap)
        except RuntimeError as exc:
            if not mmap or "mmap" not in str(exc):
                raise
            return torch.load(source, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise CheckpointLoadError(f"cannot load checkpoint {source}: no such file") from None
    except Exception as exc:
        raise CheckpointLoadError(f"cannot load checkpoint {source}: "
                                  f"{describe_load_error(exc)}") from None


def check_zip_directory(path) -> None:
    """CheckpointLoadError, from the central directory alone, for a record inflating past
    MAX_INFLATED_RECORD or stored larger than its bytes; pre-zip files pass."""
    try:
        if not zipfile.is_zipfile(path):
            return
        with zipfile.ZipFile(path) as archive:
            records = archive.infolist()
    except (OSError, zipfile.BadZipFile, ValueError):
        return          # torch.load reports what is wrong with it
    for info in records:
        inflates = info.compress_type != zipfile.ZIP_STORED and \
            info.file_size > MAX_INFLATED_RECORD
        stored_lies = info.compress_type == zipfile.ZIP_STORED and \
            info.file_size != info.compress_size
        if inflates or stored_lies:
            raise CheckpointLoadError(
                f"cannot load checkpoint {path}: record {info.filename} declares "
                f"{info.file_size:,} bytes from {info.compress_size:,} (torch writes records "
                f"stored, not compressed); not a checkpoint to trust")


def state_mismatch(config: EngineConfig, state: dict) -> str | None:
    """How `state` differs from `config`'s model (names, shapes; on the meta device), or None."""
    return state_fit(config, state)[0]


def state_fit(config: EngineConfig, state: dict) -> tuple[str | None, str | None]:
    """(state_mismatch's answer, describe_filled's line for what a load would fill)."""
    from .continuous_engine import ContinuousThoughtEngine  # it imports this module
    with torch.device("meta"):
        model = ContinuousThoughtEngine.from_config(config)
    fixed = {k: v for k, v in model.state_dict().items() if not _is_carried(k)}
    state = strip_compiled_prefix(state)
    mismatch = _mismatch(fixed, state, model)
    return mismatch, None if mismatch else describe_filled(filled_keys(model, state), model)


def filled_keys(model: torch.nn.Module, state: dict) -> list[str]:
    """Names `state` (prefix stripped) lacks that construction supplies: constant (not
    carried) buffers, and a tied weight's other names when one is given."""
    given = set(state)
    filled = [name for name, _ in model.named_buffers()
              if name not in given and not _is_carried(name)]
    tied: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        tied.setdefault(id(param), []).append(name)
    for names in tied.values():
        if len(names) > 1 and any(n in given for n in names):
            filled += [n for n in names if n not in given]
    return sorted(filled)


def describe_filled(filled: list[str], model: torch.nn.Module | None = None) -> str | None:
    """One line naming what a load filled from the model's construction (None: nothing)."""
    if not filled:
        return None
    tied = {}
    if model is not None:
        for name, param in model.named_parameters(remove_duplicate=False):
            tied.setdefault(id(param), []).append(name)
    twin = {n: next(m for m in names if m != n)
            for names in tied.values() if len(names) > 1 for n in names}
    kinds: dict[str, int] = {}
    for name in filled:
        kind = re.sub(r"^blocks\.\d+\.", "blocks.*.", name)
        kinds[kind] = kinds.get(kind, 0) + 1
    parts = [f"{kind} (x{count})" if count > 1 else
             (f"{kind} (tied to {twin[kind]})" if kind in twin else kind)
             for kind, count in kinds.items()]
    return (f"filled from the model's construction ({len(filled)} tensor(s) the file does "
            f"not hold; no learned parameter): {', '.join(parts)}")


def _mismatch(fixed: dict, state: dict, model: torch.nn.Module | None = None) -> str | None:
    given = {k: v for k, v in state.items() if not _is_carried(k)}
    fillable = set(filled_keys(model, given)) if model is not None else set()
    missing = sorted(set(fixed) - set(given) - fillable)
    unexpected = sorted(set(given) - set(fixed))
    misshaped = [f"{k} {tuple(given[k].shape)} != {tuple(fixed[k].shape)}"
                 for k in sorted(set(fixed) & set(given))
                 if not isinstance(given[k], torch.Tensor) or given[k].shape != fixed[k].shape]
    parts = [f"{what} {names[:5]}" + (f" and {len(names) - 5} more" if len(names) > 5 else "")
             for what, names in (("missing", missing), ("unexpected", unexpected),
                                 ("mis-shaped", misshaped)) if names]
    return ", ".join(parts) or None


def describe_load_error(exc: BaseException) -> str:
    """Why a weights-only load failed, in one line, without torch's weights_only=False advice."""
    if isinstance(exc, pickle.UnpicklingError):
        return ("refused: it holds pickled objects or code that a weights-only load does not "
                "allow (not a checkpoint to trust)")
    text = " ".join(str(exc).split())
    first = text.split(". ")[0].rstrip(".") if text else ""
    if "zip archive" in text or "central directory" in text or isinstance(exc, EOFError):
        return f"truncated or corrupt ({first or type(exc).__name__})"
    return f"{type(exc).__name__}: {first}"[:300]


def is_bare_state_dict(obj) -> bool:
    """A plain `model.state_dict()` saved alone: names to tensors, nothing else."""
    return (isinstance(obj, dict) and bool(obj) and "model_state" not in obj
            and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()))


def as_engine_checkpoint(ckpt: dict, config: EngineConfig | None = None) -> dict:
    """`ckpt` as `{"model_state", "config", ...}`; one without a config takes `config`
    (refused if None)."""
    if not isinstance(ckpt, dict):
        raise ValueError(f"not a Fractus checkpoint: a {type(ckpt).__name__}, not a dict")
    if "model_state" in ckpt and ckpt.get("config") is not None:
        return ckpt
    state = ckpt.get("model_state") if "model_state" in ckpt else ckpt
    if not is_bare_state_dict(state):
        raise ValueError(f"not a Fractus checkpoint: expected keys 'model_state' and 'config' "
                         f"or a bare state_dict, got {sorted(ckpt)[:8]}")
    if config is None:
        raise ValueError("a bare state_dict carries no model config: name the model "
                         "(the pod's `model:`, or --model PRESET|FILE)")
    if state is ckpt:
        return {"model_state": state, "config": config.to_dict()}
    return {**ckpt, "config": config.to_dict()}


def train_head(ckpt: dict) -> int | None:
    """The recorded next token: train_state.next_token, else v1's config.tokens_processed
    (v1 saved `start + step_tokens`, the next window's start), else None."""
    next_token = (ckpt.get("train_state") or {}).get("next_token")
    if next_token is None:
        next_token = (ckpt.get("config") or {}).get("tokens_processed")
    if isinstance(next_token, bool) or not isinstance(next_token, int):
        return None
    return next_token


def strip_compiled_prefix(state: dict) -> dict:
    return {k.replace(COMPILED_PREFIX, "", 1) if k.startswith(COMPILED_PREFIX) else k: v
            for k, v in state.items()}


def _is_carried(name: str) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    return name in ("thought_state", "last_lb_loss") or leaf in ("attn_S", "attn_z", "kuramoto_phases")


def load_engine(cls, source, map_location="cpu", batch_size: int | None = None,
                config: EngineConfig | None = None):
    """The model of any checkpoint `as_engine_checkpoint` reads."""
    ckpt = as_engine_checkpoint(read_checkpoint(source, map_location), config)
    cfg = EngineConfig.from_dict(ckpt["config"])
    model = cls.from_config(cfg)
    state = strip_compiled_prefix(ckpt["model_state"])

    fixed = {k: v for k, v in model.state_dict().items() if not _is_carried(k)}
    mismatch = _mismatch(fixed, state, model)
    if mismatch:
        raise ValueError(f"checkpoint does not match the model config: {mismatch}")
    # What the file lacks keeps the value construction gave it (a tied name shares the
    # tensor loaded under its other name); `filled_on_load` names it for the caller.
    model.load_state_dict({k: v for k, v in state.items() if not _is_carried(k)}, strict=False)
    model.filled_on_load = filled_keys(model, state)

    carried = {k: v for k, v in state.items() if _is_carried(k) and k != "last_lb_loss"}
    want = set(model.carry_state())
    stored_batch = state["thought_state"].shape[0] if "thought_state" in state else None
    if set(carried) == want and (batch_size is None or stored_batch == batch_size):
        model.load_carry_state(carried)
    else:
        new_batch = batch_size or stored_batch or 1
        if carried:
            warnings.warn(f"carried state (batch {stored_batch}) does not fit batch {new_batch}: "
                          "reset to zeros", stacklevel=2)
        model.reset_thought(new_batch)
    return model
