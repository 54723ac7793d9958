"""The merge round's gate, judged from measurements alone: a round's merged weights pass only
if, on every quorum GPU's next window, their teacher-forced loss is within `max_tf_rise` of
the GPU's own weights, and their AR probe is not Failed against the stage's baseline (no
baseline: the probe's verdict is Inconclusive and does not refuse). A measurement that
cannot run refuses the round. The `merge_gate:` section of manifests/trusted_loss.yaml
(shipped defaults); the supervisor's MergeRounds runs it; fractus/eval/merge_gate.py
measures, in a child process per GPU on that GPU (a crash or hang never takes the launcher
down).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from launcher import child
from launcher.checks.criteria import typed_section
from launcher.checks.health import FAILED
from launcher.checks.probe_check import ProbeTolerance, probe_verdict
from launcher.errors import UserError


@dataclass(frozen=True)
class MergeGate:
    max_tf_rise: float      # nats a GPU's next-window loss may rise on the merged weights
    window_tokens: int      # tokens of that window
    probe: int              # 1: the AR probe of the merged weights too; 0: not
    timeout_s: float        # one GPU's measurement; past it the round is refused


def parse_merge_gate(data, path: Path) -> MergeGate:
    gate = typed_section(MergeGate, f"{path}: merge_gate", data,
                         least={"window_tokens": 2, "timeout_s": 1})
    if gate.probe not in (0, 1):
        raise UserError(f"{path}: merge_gate.probe must be 0 or 1, got {gate.probe}")
    return gate


def measure_gpu(pod_dir: Path, checkpoint: str, merged: str, shard: str, at: int,
                gate: MergeGate, seq: int, probe: bool, device: str = "cpu", gpu: int = 0,
                threads: int = 1) -> dict:
    """`python -m fractus.eval.merge_gate --json` for one GPU -> its result; RuntimeError
    (one line) when it cannot run. `device` "cuda": on GPU `gpu` (its worker is paused at
    the round's boundary), else on `threads` CPU threads."""
    command = ["python", "-m", "fractus.eval.merge_gate", "--checkpoint", checkpoint,
               "--merged", merged, "--shard", shard, "--at", str(at),
               "--tokens", str(gate.window_tokens), "--seq", str(seq),
               "--device", "cuda" if device == "cuda" else "cpu"]
    if probe:
        command.append("--probe")
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               CUDA_VISIBLE_DEVICES=str(gpu) if device == "cuda" else "")
    try:
        done = child.run(command, cwd=pod_dir, env=env, timeout_s=gate.timeout_s)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the gate's measurement timed out after {gate.timeout_s:g} s") \
            from None
    if done.returncode != 0:
        lines = [s for s in done.stderr.splitlines() if s.strip()]
        raise RuntimeError(f"the gate's measurement exited {done.returncode}: "
                           f"{lines[-1][:300] if lines else 'no output'}")
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise RuntimeError("the gate's measurement printed no JSON result") from None


def judge(measured: dict[int, dict], gate: MergeGate, baseline,
          tolerance: ProbeTolerance) -> tuple[bool, str, dict]:
    """(passed, one-line reason, the gate's record) from each GPU's measurement."""
    record: dict = {"gpus": {}, "limit": gate.max_tf_rise, "probe": None}
    worst = None
    for gpu, m in sorted(measured.items()):
        own, merged = m.get("own_tf"), m.get("merged_tf")
        if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in (own, merged)):
            return False, f"GPU {gpu}: the merged weights' loss is not finite ({merged!r})", \
                record
        rise = merged - own
        record["gpus"][str(gpu)] = {"own_tf": own, "merged_tf": merged, "rise": rise}
        if worst is None or rise > worst[1]:
            worst = (gpu, rise)
    if worst is None:
        return False, "no GPU was measured", record
    if worst[1] > gate.max_tf_rise:
        return False, (f"GPU {worst[0]}'s next-window loss rises by {worst[1]:.4f} on the "
                       f"merged weights, above merge_gate.max_tf_rise {gate.max_tf_rise:g}"), \
            record
    probed = next((m["probe"] for m in measured.values() if m.get("probe")), None)
    if probed is not None:
        status, why = probe_verdict(probed, baseline, tolerance)
        record["probe"] = {"status": status, "reason": why, "ar": probed.get("ar")}
        if status == FAILED:
            return False, f"the merged weights' AR probe failed: {why}", record
    return True, (f"every GPU's next-window loss within {gate.max_tf_rise:g} (worst "
                  f"{worst[1]:+.4f}, GPU {worst[0]})"), record
