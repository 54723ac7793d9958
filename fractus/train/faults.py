"""Fault injection for tests of the worker and its supervisor. Off unless FRACTUS_FAULT is set.

`FRACTUS_FAULT=<kind>@<step>` fires once, before global step `<step>` (1-based, across
resumes), and drives the worker's real path (non-finite, OOM, crash, compile fallback, a
kill at the worst moment). The kinds: docs/WORKER.md, "Fault injection (tests only)".
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

import torch

KINDS = ("nan", "oom", "hang", "crash", "compile", "diverge", "kill_after_save", "save_hang",
         "pause")


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int


def parse_fault(spec: str | None) -> Fault | None:
    if spec is None or not spec.strip():
        return None
    kind, sep, step = spec.strip().partition("@")
    if not sep or kind not in KINDS or not step.isdigit() or int(step) < 1:
        raise ValueError(f"must be <kind>@<step> with kind in {', '.join(KINDS)} and step >= 1")
    return Fault(kind, int(step))


class FaultInjector:
    """Asks, at fixed points of a step, whether the configured fault fires there."""

    def __init__(self, fault: Fault | None):
        self.fault = fault

    def _fires(self, kind: str, step: int) -> bool:
        return self.fault is not None and self.fault.kind == kind and self.fault.step == step

    def before_step(self, step: int) -> None:
        if self._fires("pause", step):   # SIGSTOP: a test acts at this boundary, then SIGCONTs
            os.kill(os.getpid(), signal.SIGSTOP)
        if self._fires("hang", step):
            while True:  # a stuck worker: only a second signal or SIGKILL ends it
                time.sleep(3600)
        if self._fires("crash", step):
            raise RuntimeError(f"injected crash at step {step} (FRACTUS_FAULT)")
        if self._fires("oom", step):
            raise torch.OutOfMemoryError(f"injected out of memory at step {step} (FRACTUS_FAULT)")

    def loss_scale(self, step: int) -> float | None:
        """NaN at the nan step (the caller multiplies the loss by it), else None."""
        return float("nan") if self._fires("nan", step) else None

    def compile_fails(self, step: int) -> bool:
        return self._fires("compile", step)

    def compiled_ce(self, step: int, ce: torch.Tensor) -> torch.Tensor:
        """The compiled step's cross-entropy: doubled at the diverge step, else as is."""
        return ce * 2 if self._fires("diverge", step) else ce

    def after_save(self, step: int) -> None:
        if self._fires("kill_after_save", step):
            os.kill(os.getpid(), signal.SIGKILL)

    def save_write_hook(self, step: int):
        """None, or for `step`'s save an `on_write` hook that hangs once bytes are written."""
        if not self._fires("save_hang", step):
            return None

        def hang_once_written(written: int) -> None:
            while written:
                time.sleep(3600)
        return hang_once_written
