"""The worker's metrics as TensorBoard scalars (TB_DIR), beside the JSON lines.

The METRICS file stays the contract (the launcher reads only it); these event files are for
people: `tensorboard --logdir logs/tb` shows one run per GPU. Written by
torch.utils.tensorboard's SummaryWriter, whose writer thread does the file I/O, so a
metrics line costs the training loop one queue put per scalar.
"""

from __future__ import annotations

import math

# Metrics-line field -> TensorBoard tag (grouped as TensorBoard shows them).
SCALAR_TAGS = {
    "tf": "loss/tf", "ema_tf": "loss/ema_tf", "ss": "loss/ss", "ema_ss": "loss/ema_ss",
    "lb": "lb", "grad_norm": "grad_norm", "tok_s": "tok_s", "mem_gb": "mem_gb",
}
STAGE_TAG = "stage"
FLUSH_SECS = 5      # a line reaches the file within this (TensorBoard polls its logdir)


class TensorBoardScalars:
    """One run directory per worker; `metrics(record)` takes a METRICS metrics record."""

    def __init__(self, run_dir: str, stage: int | None):
        from torch.utils.tensorboard import SummaryWriter
        self._writer = SummaryWriter(log_dir=run_dir, flush_secs=FLUSH_SECS)
        self._stage = stage

    def metrics(self, record: dict) -> None:
        step, wall_time = record["step"], record["ts"]
        for field, tag in SCALAR_TAGS.items():
            value = record.get(field)
            if isinstance(value, (int, float)) and math.isfinite(value):   # null: no point
                self._writer.add_scalar(tag, value, step, walltime=wall_time)
        if self._stage is not None:
            self._writer.add_scalar(STAGE_TAG, self._stage, step, walltime=wall_time)

    def close(self) -> None:
        self._writer.close()
