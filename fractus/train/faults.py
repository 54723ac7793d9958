"""Fault injection for tests of the worker and its supervisor. Off unless FRACTUS_FAULT is set.

`FRACTUS_FAULT=<kind>@<step>` fires once, when the worker is about to run global step
`<step>` (1-based, counted across resumes like the `step` of the metrics lines):

- `nan`: the step's loss is multiplied by NaN, so the real non-finite path runs (exit 3).
- `oom`: raises torch.OutOfMemoryError inside the step, so the real OOM handler runs (exit 4).
- `crash`: raises RuntimeError inside the step (error event, exit 1).
- `hang`: sleeps forever before the step (a stuck worker, for watchdog tests).
- `compile`: with COMPILE=1, the compiled chunk function fails at that step's first call,
  so the compile fallback runs (a `compile` event, the step retried uncompiled).
- `diverge`: with COMPILE=1, the compiled step's cross-entropy at that step is doubled (the
  eager step's is not), so the first compiled step falls outside the band of the eager one.
- `kill_after_save`: the worker SIGKILLs itself right after the checkpoint of that step is
  renamed into place and before its `checkpoint` event: the file is newer than anything
  the launcher was told about (a real kill -9 at the worst moment).
- `save_hang`: the write of the checkpoint of that step stops for good once its first bytes
  are in the temp file (a write in flight when the worker is killed or signalled).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

KINDS = ("nan", "oom", "hang", "crash", "compile", "diverge", "kill_after_save", "save_hang")


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
            import os
            import signal
            os.kill(os.getpid(), signal.SIGKILL)

    def save_write_hook(self, step: int):
        """For the checkpoint of `step`: None, or a hook on the temp file's byte count that
        never returns once bytes are written (save_checkpoint's `on_write`)."""
        if not self._fires("save_hang", step):
            return None

        def hang_once_written(written: int) -> None:
            while written:
                time.sleep(3600)
        return hang_once_written
