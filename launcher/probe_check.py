"""The AR probe as a health check (issue 6): its verdict against the stage's baseline AR.

The probe itself is fractus/eval/probe.py. Here: the tolerance (the `probe:` section of
trusted_loss.yaml, with defaults), the verdict, and a runner that probes in another
process, so training never waits for it and a probe that crashes, hangs or cannot read
its files makes the check Inconclusive instead of taking the launcher down.

    result = run_probe_process("checkpoints/fractus_1b_gpu0.pt", "data/shard_phase2_gpu0.npy")
    status, reason = probe_verdict(result, baseline_ar=5.31, tolerance=load_probe_tolerance(path))

Verdicts (the health checks' vocabulary):
    Failed        AR above baseline + tolerance, or not finite (the model emits NaN/Inf)
    Inconclusive  the probe could not run, or there is no finite baseline to compare with
    Successful    AR within the tolerance of the baseline
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from launcher import child
from launcher.errors import UserError
from launcher.health import FAILED, INCONCLUSIVE, SUCCESSFUL
from launcher.yamlfile import read_yaml


@dataclass(frozen=True)
class ProbeTolerance:
    """AR may exceed its baseline by `band` nats, or by `relativeBand` x |baseline| when
    set (which then wins, as in the lb_band check)."""
    band: float = 0.25
    relativeBand: float | None = None

    def limit(self, baseline: float) -> float:
        if self.relativeBand is not None:
            return self.relativeBand * abs(baseline)
        return self.band


@dataclass(frozen=True)
class ProbeSchedule:
    """When the supervisor probes (launcher/probe_monitor.py): every `every`-th new
    checkpoint of each GPU (0 = never), at most `parallel` probe processes at once across
    the pod, each killed after `timeout_s` (the check is then Inconclusive)."""
    every: int = 0
    parallel: int = 1
    timeout_s: float = 900.0


_TOLERANCE_KEYS = {"band", "relativeBand"}
_SCHEDULE_KEYS = {"every": int, "parallel": int, "timeout_s": float}


def _probe_section(criteria_path: str | Path) -> tuple[Path, dict]:
    path = Path(criteria_path)
    data = read_yaml(path, "criteria file") or {}
    section = (data.get("probe") if isinstance(data, dict) else None) or {}
    if not isinstance(section, dict) or set(section) - _TOLERANCE_KEYS - set(_SCHEDULE_KEYS):
        raise UserError(f"{path}: probe: expected keys from "
                        f"{sorted(_TOLERANCE_KEYS | set(_SCHEDULE_KEYS))}, got {section!r}")
    return path, section


def _schedule_values(path: Path, section: dict) -> dict:
    values = {}
    for key, kind in _SCHEDULE_KEYS.items():
        if key not in section:
            continue
        value = section[key]
        least = 0 if key == "every" else 1
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= least \
                or (kind is int and value != int(value)):
            raise UserError(f"{path}: probe.{key}: expected "
                            f"{'an integer' if kind is int else 'a number'} >= {least}, "
                            f"got {value!r}")
        values[key] = kind(value)
    return values


def load_probe_tolerance(criteria_path: str | Path) -> ProbeTolerance:
    """The `probe:` section of trusted_loss.yaml; defaults for what is missing. The
    schedule keys are checked too, so one call refuses any mistake in the section."""
    path, section = _probe_section(criteria_path)
    _schedule_values(path, section)
    values = {}
    for key, value in section.items():
        if key not in _TOLERANCE_KEYS or (value is None and key == "relativeBand"):
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise UserError(f"{path}: probe.{key}: expected a number >= 0, got {value!r}")
        values[key] = float(value)
    return ProbeTolerance(**values)


def load_probe_schedule(criteria_path: str | Path) -> ProbeSchedule:
    """The schedule keys of the `probe:` section (every, parallel, timeout_s)."""
    path, section = _probe_section(criteria_path)
    return ProbeSchedule(**_schedule_values(path, section))


def _ar_of(result) -> float | None:
    """AR from a ProbeResult, its dict (--json output), or None."""
    if result is None:
        return None
    value = result.get("ar") if isinstance(result, dict) else getattr(result, "ar", None)
    return float(value) if isinstance(value, (int, float)) else value


def probe_verdict(result, baseline_ar: float | None,
                  tolerance: ProbeTolerance = ProbeTolerance(),
                  error: str | None = None) -> tuple[str, str]:
    """(status, reason) for one probe `result` (ProbeResult, its dict, or None when the
    probe could not run; `error` then says why) against the stage's `baseline_ar`."""
    if result is None or error is not None:
        return INCONCLUSIVE, f"probe could not run: {error or 'no result'}"
    ar = _ar_of(result)
    if not isinstance(ar, float) or not math.isfinite(ar):
        return FAILED, f"AR is not finite ({ar!r}): the model's free-run logits are NaN/Inf"
    if baseline_ar is None or not math.isfinite(baseline_ar):
        return INCONCLUSIVE, (f"AR {ar:.4f}, but no finite baseline AR to compare with "
                              f"({baseline_ar!r})")
    limit = tolerance.limit(baseline_ar)
    rise = ar - baseline_ar
    how = (f"relativeBand {tolerance.relativeBand:g}" if tolerance.relativeBand is not None
           else f"band {tolerance.band:g}")
    if rise > limit:
        return FAILED, (f"AR {ar:.4f} above baseline {baseline_ar:.4f} by {rise:.4f} > "
                        f"{limit:.4f} ({how})")
    return SUCCESSFUL, (f"AR {ar:.4f} vs baseline {baseline_ar:.4f} ({rise:+.4f}, "
                        f"limit {limit:.4f}, {how})")


class ProbeUnavailable(RuntimeError):
    """The probe process could not produce a result (the check is Inconclusive)."""


def run_probe_process(checkpoint: str | Path, shard: str | Path, head: int | None = None,
                      rows: int | None = None, device: str = "cpu", timeout_s: float = 900,
                      cwd: str | Path | None = None, threads: int = 1) -> dict:
    """`python -m fractus.eval.probe --json` in a child process -> its result dict
    (ar, ar_acc, cold_tf, start, rows, next_token). Raises ProbeUnavailable."""
    command = ["python", "-m", "fractus.eval.probe", "--checkpoint", str(checkpoint),
               "--shard", str(shard), "--device", device, "--json"]
    if head is not None:
        command += ["--head", str(head)]
    if rows is not None:
        command += ["--rows", str(rows)]
    env = dict(os.environ)
    if device == "cpu":   # never fight the training workers for every core
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
                   CUDA_VISIBLE_DEVICES="")
    try:
        done = child.run(command, cwd=cwd, env=env, timeout_s=timeout_s)
    except subprocess.TimeoutExpired:
        raise ProbeUnavailable(f"probe timed out after {timeout_s:g} s") from None
    if done.returncode != 0:
        lines = [s for s in done.stderr.splitlines() if s.strip()]
        raise ProbeUnavailable(f"probe exited {done.returncode}: "
                               f"{lines[-1][:300] if lines else 'no output'}")
    for line in reversed(done.stdout.splitlines()):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "ar" in record:
            return record
    raise ProbeUnavailable("probe printed no JSON result")


@dataclass(frozen=True)
class ProbeCheck:
    status: str
    reason: str
    result: dict | None

    def to_dict(self) -> dict:
        return {"status": self.status, "reason": self.reason, "result": self.result}


def check_probe(checkpoint: str | Path, shard: str | Path, baseline_ar: float | None,
                tolerance: ProbeTolerance = ProbeTolerance(), **probe_kwargs) -> ProbeCheck:
    """Probe in another process and judge it; never raises for a probe that cannot run."""
    try:
        result = run_probe_process(checkpoint, shard, **probe_kwargs)
    except ProbeUnavailable as exc:
        status, reason = probe_verdict(None, baseline_ar, tolerance, error=str(exc))
        return ProbeCheck(status, reason, None)
    status, reason = probe_verdict(result, baseline_ar, tolerance)
    return ProbeCheck(status, reason, result)
