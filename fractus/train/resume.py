"""Where a worker starts: a fresh model, a legacy weights-only file, or a full checkpoint.

Every check runs before the worker writes anything (SettingsError: one line, exit 2).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fractus.config import EngineConfig, load_model_config
from fractus.train.checkpoint import is_full, load_checkpoint
from fractus.train.env import MERGED_BRAIN, SettingsError, WorkerSettings
from fractus.train.merge_inbox import MAX_ROUND

DEFAULT_MODEL = "1b"          # v1's TARGET config (vocab 50257)


@dataclass
class StartPoint:
    """What the worker resumes from (decided before the model is built)."""
    config: EngineConfig
    next_token: int
    source: str | None = None          # checkpoint path, None for a fresh model
    kind: str = "fresh"                # "fresh" | "legacy" | "full"
    checkpoint: dict | None = None
    step: int = 0
    ema_tf: float | None = None
    ema_ss: float | None = None
    rng: dict | None = None
    merge_round: int = 0               # the last merge round these weights adopted
    warnings: list[str] = field(default_factory=list)


def resolve_device(settings: WorkerSettings) -> torch.device:
    name = settings.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise SettingsError(f"DEVICE is {name} but CUDA is not available (use DEVICE=cpu)")
    device = torch.device(name)
    if device.type == "cuda":
        if device.index is None:  # torch.cuda.set_device and RNG calls want an index
            device = torch.device("cuda", 0)
        if device.index >= torch.cuda.device_count():
            raise SettingsError(f"DEVICE is {name} but only {torch.cuda.device_count()} "
                                "CUDA device(s) are visible")
    return device


def _model_config(settings: WorkerSettings, ck: dict | None) -> EngineConfig:
    try:
        wanted = load_model_config(settings.model) if settings.model else None
        stored = (EngineConfig.from_dict(ck["config"])
                  if ck is not None and ck["config"] is not None else None)
    except (ValueError, TypeError, OSError) as e:
        raise SettingsError(f"MODEL: {e}") from None
    if wanted and stored and wanted != stored:
        raise SettingsError(f"MODEL={settings.model} does not match the checkpoint's config "
                            f"({stored.to_dict()})")
    return stored or wanted or load_model_config(DEFAULT_MODEL)


def _source(settings: WorkerSettings) -> Path | None:
    """CKPT_IN, else v1's chain: the GPU's own file (CKPT_OUT), then the merged brain; None
    only when ALLOW_FRESH_START=1 says a new random model is wanted."""
    if settings.ckpt_in is not None:
        source = Path(settings.ckpt_in)
        if not source.is_file():
            raise SettingsError(f"CKPT_IN not found: {source}")
        return source
    chain = [Path(settings.ckpt_out_path), Path(MERGED_BRAIN)]
    found = next((path for path in chain if path.is_file()), None)
    if found is None and not settings.allow_fresh_start:
        raise SettingsError(f"no checkpoint to start from: CKPT_IN is unset and neither "
                            f"{chain[0]} nor {chain[1]} exists; set CKPT_IN, or "
                            f"ALLOW_FRESH_START=1 to train a new random model")
    return found


def find_start(settings: WorkerSettings, shard_len: int) -> StartPoint:
    """Read the checkpoint to resume from (see _source) and decide the first token."""
    source = _source(settings)

    ck = None
    if source is not None:
        try:
            ck = load_checkpoint(source)
        except ValueError as e:  # truncated, corrupt, foreign or pickled code: one line
            raise SettingsError(str(e)) from None
    config = _model_config(settings, ck)
    if ck is not None and ck["config"] is None:    # a bare state_dict: MODEL's config
        ck = {**ck, "config": config.to_dict()}

    if ck is None:
        start = StartPoint(config, settings.start_token or 0)
    elif is_full(ck):
        ts = ck["train_state"]
        start = StartPoint(config, int(ts["next_token"]), str(source), "full", ck,
                           step=int(ts["step"]), ema_tf=ts["ema_tf"], ema_ss=ts["ema_ss"],
                           rng=ts["rng"], merge_round=_merge_round(ts, source))
        if _phase_start(settings, ts, source):
            start.next_token = 0      # the new phase's shard from its first token
        elif settings.start_token is not None and settings.start_token != start.next_token:
            if not settings.force_start_token:
                raise SettingsError(
                    f"START_TOKEN={settings.start_token} disagrees with the checkpoint "
                    f"{source} (next_token={start.next_token}); unset START_TOKEN to resume "
                    "there, or set FORCE_START_TOKEN=1")
            start.warnings.append(f"FORCE_START_TOKEN: starting at {settings.start_token}, "
                                  f"not at the checkpoint's next_token {start.next_token}")
            start.next_token = settings.start_token
    else:
        if settings.start_token is None:
            raise SettingsError(f"START_TOKEN is required with the weights-only checkpoint "
                                f"{source} (it records no exact token offset)")
        start = StartPoint(config, settings.start_token, str(source), "legacy", ck)
        start.warnings.append(f"{source} holds weights only: SGD momentum and RNG restart "
                              "(the run continues, but not bitwise as if uninterrupted)")

    if start.next_token > shard_len:
        raise SettingsError(f"START_TOKEN={start.next_token} is past the end of the shard "
                            f"({shard_len} tokens)")
    return start


def _merge_round(train_state: dict, source: Path) -> int:
    """train_state.merge_round, absent = 0; anything but a round number is refused."""
    value = train_state.get("merge_round", 0)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_ROUND:
        raise SettingsError(f"checkpoint {source} records merge_round {value!r}, not a round "
                            f"number (0..{MAX_ROUND})"[:300])
    return value


def _phase_start(settings: WorkerSettings, train_state: dict, source: Path) -> bool:
    """A data phase's first start: the checkpoint ended phase PHASE-1 (none recorded: 1) and
    START_TOKEN=0. Any other phase is refused: it would re-train or skip one."""
    recorded = train_state.get("phase", 1)
    if not isinstance(recorded, int) or isinstance(recorded, bool) or recorded < 1:
        raise SettingsError(f"checkpoint {source} records phase {recorded!r}, not a phase "
                            f"number")
    if recorded == settings.phase:
        return False
    if recorded == settings.phase - 1 and settings.start_token == 0:
        return True
    if recorded == settings.phase - 1:
        raise SettingsError(f"checkpoint {source} ends phase {recorded}: phase "
                            f"{settings.phase} starts from it at START_TOKEN=0, got "
                            f"START_TOKEN={settings.start_token}")
    raise SettingsError(f"checkpoint {source} is of data phase {recorded}, not phase "
                        f"{settings.phase} (PHASE) or the one before; set PHASE to "
                        f"{recorded} to resume it")


def build_model(start: StartPoint, batch: int, device: torch.device):
    """(the engine at `start`, the checkpoint's carried batch or None); carried state is
    reset to `batch` when it differs."""
    from fractus.continuous_engine import ContinuousThoughtEngine  # the engine (and its kernels) only when a model is built
    if start.checkpoint is None:
        model = ContinuousThoughtEngine(**start.config.to_dict())
        model.reset_thought(batch)
        stored_batch = None
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the worker reports a batch change as an event
            try:
                model = ContinuousThoughtEngine.from_checkpoint(start.checkpoint, batch_size=None)
            except ValueError as e:
                raise SettingsError(f"checkpoint {start.source}: {e}") from None
        stored_batch = model.carried_batch_size
        if stored_batch != batch:
            model.reset_thought(batch)
    return model.to(device), stored_batch
