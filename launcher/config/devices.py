"""The pod's `devices:` string (and launch's `--gpus`) resolved to worker slots: one GPU_ID
each and how its device is exposed. Bounded and ASCII-only, so a malformed string is one line
before anything starts."""

from __future__ import annotations

import re
from dataclasses import dataclass

from launcher.config.gpus import visible_gpu_count
from launcher.errors import UserError


@dataclass(frozen=True)
class Slot:
    """One worker: GPU_ID and how the device is exposed to it."""
    gpu: int
    device: str          # "cpu" or "cuda"


def _visible_gpu_count() -> int:
    return visible_gpu_count()       # nvidia-smi, else torch (absent/failing)


# Bounds of a devices string: no machine has more GPUs, more CPU workers would only thrash,
# and an unbounded range builds a list until memory runs out.
MAX_GPU_INDEX = 1023
MAX_CPU_WORKERS = 256


def _index(text: str, whole: str, source: str) -> int:
    # ASCII digits only: str.isdigit() is true for "²" and "١", which int() then refuses.
    if not re.fullmatch(r"[0-9]+", text) or int(text) > MAX_GPU_INDEX:
        raise UserError(f"{source}: bad GPU list {whole!r}; write indices 0..{MAX_GPU_INDEX} "
                        f"as e.g. 0,1,2 or 0-7")
    return int(text)


def _index_list(text: str, source: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        lo, dash, hi = part.strip().partition("-")
        first = _index(lo.strip(), text, source)
        last = _index(hi.strip(), text, source) if dash else first
        if last < first:
            raise UserError(f"{source}: range {part.strip()!r} in {text!r} runs backwards; "
                            f"write it low-high ({last}-{first})")
        out.extend(range(first, last + 1))
    if len(set(out)) != len(out):
        raise UserError(f"{source}: GPU listed twice in {text!r}; list each once")
    return out


def parse_devices(spec: str, gpus: str | None = None) -> list[Slot]:
    """Resolve a devices string (and an optional --gpus subset) to worker slots."""
    spec = spec.strip()
    kind, _, rest = spec.partition(":")
    if kind == "auto":
        count = _visible_gpu_count()
        slots = [Slot(i, "cuda") for i in range(count)] or [Slot(i, "cpu") for i in range(2)]
    elif kind == "cpu":
        if not re.fullmatch(r"[0-9]+", rest) or not 1 <= int(rest) <= MAX_CPU_WORKERS:
            raise UserError(f"devices: expected cpu:N with N from 1 to {MAX_CPU_WORKERS}, got "
                            f"{spec!r}; e.g. cpu:2")
        slots = [Slot(i, "cpu") for i in range(int(rest))]
    elif kind == "cuda":
        indices = _index_list(rest, "devices") if rest else list(range(_visible_gpu_count()))
        if not indices:
            raise UserError("devices: cuda requested but no GPU is visible (try --devices cpu:2)")
        slots = [Slot(i, "cuda") for i in indices]
    else:
        raise UserError(f"devices: expected auto, cpu:N or cuda[:LIST], got {spec!r}; e.g. "
                        f"cpu:2 or cuda:0-7")
    if gpus:
        wanted = _index_list(gpus, "--gpus")
        have = {s.gpu for s in slots}
        missing = [g for g in wanted if g not in have]
        if missing:
            raise UserError(f"--gpus {gpus}: GPU(s) {missing} not in devices {spec!r}; pick "
                            f"from {sorted(have)} or change devices")
        slots = [s for s in slots if s.gpu in wanted]
    return slots
