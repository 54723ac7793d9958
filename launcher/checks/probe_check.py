"""The AR probe (fractus/eval/probe.py) as a health check, judged from its result alone; a
probe that crashes, hangs or cannot read its files is Inconclusive. It runs in a child
process, so training never waits for it and no probe takes the launcher down. The allowed
rise is k standard errors of the window noise, sigma = s * sqrt(1/R_b + 1/R_c) (s: the
spread of the baseline's R_b windows; R_c: the probe's), never below a floor; a free run
off-manifold (AR > ln(V), ARacc <= offManifoldAcc) from a measured baseline that beat ln(V)
fails whatever the rise. Why, the verdict table and measurements: docs/CANARY.md "The AR
probe verdict".
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from launcher import child
from launcher.errors import UserError, refuse_unknown_keys
from launcher.checks.criteria import typed_section
from launcher.checks.health import FAILED, INCONCLUSIVE, SUCCESSFUL


@dataclass(frozen=True)
class Baseline:
    """The AR a stage's probes are judged against, with what it was measured on."""
    ar: float
    ar_rows: tuple[float, ...] = ()    # the AR of each baseline window: the noise
    ar_acc: float | None = None
    vocab_size: int | None = None

    @classmethod
    def of(cls, value) -> "Baseline | None":
        """From a number (no noise known), a ProbeResult or its dict, a record, or None."""
        if value is None or isinstance(value, Baseline):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return cls(float(value))
        get = value.get if isinstance(value, dict) else lambda k: getattr(value, k, None)
        ar = get("ar")
        if isinstance(ar, bool) or not isinstance(ar, (int, float)):
            return None
        rows = get("ar_rows") or ()
        acc, vocab = get("ar_acc"), get("vocab_size")
        return cls(float(ar), tuple(float(r) for r in rows),
                   float(acc) if isinstance(acc, (int, float)) else None,
                   int(vocab) if isinstance(vocab, int) else None)

    def windows(self) -> list[float]:
        """The windows' ARs that are numbers (a NaN window says nothing of the noise)."""
        return [r for r in self.ar_rows if math.isfinite(r)]

    def spread(self) -> float | None:
        """Sample standard deviation of the windows' ARs; None under two windows."""
        rows = self.windows()
        if len(rows) < 2:
            return None
        mean = sum(rows) / len(rows)
        return math.sqrt(sum((r - mean) ** 2 for r in rows) / (len(rows) - 1))


def uniform_ar(vocab_size: int) -> float:
    """CE of a uniform guess over the vocabulary: ln(V) (10.82 for GPT-2's 50257)."""
    return math.log(vocab_size)


@dataclass(frozen=True)
class ProbeTolerance:
    """Floor of the allowed rise: `band` nats, or `relativeBand` x |baseline| when set
    (which then wins, as in lb_band)."""
    band: float
    relativeBand: float | None
    k: float
    offManifoldAcc: float

    def floor(self, baseline_ar: float) -> float:
        if self.relativeBand is not None:
            return self.relativeBand * abs(baseline_ar)
        return self.band

    def limit(self, baseline: Baseline, check_rows: int) -> tuple[float, str]:
        """(the largest rise that passes, how it was set) for a probe of `check_rows` windows."""
        floor = self.floor(baseline.ar)
        how_floor = (f"relativeBand {self.relativeBand:g}" if self.relativeBand is not None
                     else f"band {self.band:g}")
        spread = baseline.spread()
        if spread is None:
            return floor, f"{how_floor}; baseline noise unknown"
        windows = len(baseline.windows())
        sigma = spread * math.sqrt(1 / windows + 1 / max(1, check_rows))
        noise = (f"noise sigma {sigma:.4f} from the spread {spread:.4f} of "
                 f"{windows} baseline windows")
        if self.k * sigma >= floor:
            return self.k * sigma, f"k {self.k:g} x {noise}"
        return floor, f"floor {how_floor} > k {self.k:g} x {noise}"

    def off_manifold(self, ar: float, ar_acc: float | None, vocab_size: int | None) -> bool | None:
        """None when the probe does not say (no ARacc or no vocabulary size)."""
        if ar_acc is None or vocab_size is None:
            return None
        return ar_acc <= self.offManifoldAcc and ar > uniform_ar(vocab_size)


@dataclass(frozen=True)
class ProbeSchedule:
    """Every `every`-th checkpoint of a GPU (0 = never), `parallel` at most across the pod,
    killed after `timeout_s` (Inconclusive), on `rows` windows (None: the probe's default)."""
    every: int
    parallel: int
    timeout_s: float
    rows: int | None


def parse_probe(section, path: Path) -> tuple[ProbeTolerance, ProbeSchedule]:
    where = f"{path}: probe"
    if not isinstance(section, dict):
        raise UserError(f"{where}: expected a mapping, got {section!r}")
    schedule = [f.name for f in dataclasses.fields(ProbeSchedule)]
    refuse_unknown_keys(section, [*schedule, *(f.name for f in
                                               dataclasses.fields(ProbeTolerance))], where)
    return (typed_section(ProbeTolerance, where,
                          {k: v for k, v in section.items() if k not in schedule}),
            typed_section(ProbeSchedule, where, {k: section[k] for k in schedule
                                                 if k in section},
                          least={"parallel": 1, "rows": 1, "timeout_s": 1}))


def _field(result, key: str):
    """A number from a ProbeResult or its dict (--json output); None when absent."""
    value = result.get(key) if isinstance(result, dict) else getattr(result, key, None)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        else value


def manifold_note(result, tolerance: ProbeTolerance, baseline: Baseline | None = None,
                  passed: bool = False) -> str:
    """Where the free run stands against ln(V) ('' unknown); `passed`: why above is no fail."""
    vocab, ar, acc = _field(result, "vocab_size"), _field(result, "ar"), _field(result, "ar_acc")
    if not isinstance(vocab, float) or not isinstance(ar, float) or not math.isfinite(ar):
        return ""
    level = uniform_ar(int(vocab))
    if ar <= level:
        return f"; AR at or below the uniform guess ln(V) {level:.2f}"
    off = tolerance.off_manifold(ar, acc, int(vocab))
    hits = f", ARacc {acc:.3f}" if isinstance(acc, float) else ""
    if not passed:
        return f"; AR above the uniform guess ln(V) {level:.2f}" + (
            f"; off-manifold (ARacc {acc:.3f})" if off else "")
    if baseline is not None and baseline.ar > level:
        return (f"; the model does not generate yet: like its baseline, its free run scores "
                f"above the uniform guess ln(V) {level:.2f}{hits}, so only the rise is judged")
    if off:      # only against a baseline that records no free run (a bare number)
        return (f"; its free run scores above the uniform guess ln(V) {level:.2f}{hits}, "
                f"but the baseline (a bare AR) records no free run to compare: only the "
                f"rise is judged")
    return f"; AR above the uniform guess ln(V) {level:.2f}, still generating{hits}"


def probe_verdict(result, baseline, tolerance: ProbeTolerance,
                  error: str | None = None) -> tuple[str, str]:
    """(status, reason) for `result` (ProbeResult, its dict, or None with `error` when the
    probe could not run) against `baseline` (anything Baseline.of reads)."""
    if result is None or error is not None:
        return INCONCLUSIVE, f"probe could not run: {error or 'no result'}"
    ar = _field(result, "ar")
    if not isinstance(ar, float) or not math.isfinite(ar):
        return FAILED, f"AR is not finite ({ar!r}): the model's free-run logits are NaN/Inf"
    note = manifold_note(result, tolerance)
    base = baseline if isinstance(baseline, Baseline) else Baseline.of(baseline)
    if base is None or not math.isfinite(base.ar):
        return INCONCLUSIVE, (f"AR {ar:.4f}, but no finite baseline AR to compare with "
                              f"({baseline!r}){note}")
    vocab = _field(result, "vocab_size")
    if isinstance(vocab, float) and tolerance.off_manifold(ar, _field(result, "ar_acc"), int(vocab)) \
            and base.ar_acc is not None and base.ar <= uniform_ar(int(vocab)):
        return FAILED, (f"AR {ar:.4f} vs baseline {base.ar:.4f}: the free run went "
                        f"off-manifold (the baseline beat the uniform guess){note}")
    rows = len(_field(result, "ar_rows") or ()) or int(_field(result, "rows") or 1)
    limit, how = tolerance.limit(base, rows)
    rise = ar - base.ar
    # Said as a rise (with relativeBand 1 it equals the baseline: no AR limit misread).
    if rise > limit:
        return FAILED, (f"AR {ar:.4f} above baseline {base.ar:.4f} by {rise:.4f} > "
                        f"{limit:.4f} allowed ({how}){note}")
    return SUCCESSFUL, (f"AR {ar:.4f} vs baseline {base.ar:.4f}: rise {rise:+.4f} within "
                        f"the {limit:.4f} allowed ({how})"
                        f"{manifold_note(result, tolerance, base, passed=True)}")


class ProbeUnavailable(RuntimeError):
    """The probe process produced no result (Inconclusive)."""

    bad_input = False


class ProbeRefusedInput(ProbeUnavailable):
    """The probe exited 2: its checkpoint or shard is unusable (`detail`: its reason)."""

    bad_input = True

    def __init__(self, message: str, detail: str):
        super().__init__(message)
        self.detail = detail


class ProbeLost(ProbeUnavailable):
    """The probe's machine is gone (a lost Ray node): abandoned, no verdict at all."""


def run_probe_process(checkpoint: str | Path, shard: str | Path, head: int | None = None,
                      rows: int | None = None, device: str = "cpu", timeout_s: float = 900,
                      cwd: str | Path | None = None, threads: int = 1,
                      model: str | None = None, default_head: int | None = None) -> dict:
    """`python -m fractus.eval.probe --json` in a child process -> its result dict; raises
    ProbeUnavailable. `head` overrides the checkpoint's train head; `default_head` is used
    when it records none; `model`: the config of a bare state_dict (preset or file)."""
    command = ["python", "-m", "fractus.eval.probe", "--checkpoint", str(checkpoint),
               "--shard", str(shard), "--device", device, "--json"]
    if head is not None:
        command += ["--head", str(head)]
    if default_head is not None:
        command += ["--default-head", str(default_head)]
    if rows is not None:
        command += ["--rows", str(rows)]
    if model is not None:
        command += ["--model", model]
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
        last = lines[-1][:300] if lines else "no output"
        if done.returncode == 2:
            raise ProbeRefusedInput(f"probe exited 2: {last}", last.removeprefix("error: "))
        raise ProbeUnavailable(f"probe exited {done.returncode}: {last}")
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


def check_probe(checkpoint: str | Path, shard: str | Path, baseline,
                tolerance: ProbeTolerance, **probe_kwargs) -> ProbeCheck:
    """Probe in a child process and judge it; never raises for a probe that cannot run."""
    try:
        result = run_probe_process(checkpoint, shard, **probe_kwargs)
    except ProbeUnavailable as exc:
        status, reason = probe_verdict(None, baseline, tolerance, error=str(exc))
        return ProbeCheck(status, reason, None)
    status, reason = probe_verdict(result, baseline, tolerance)
    return ProbeCheck(status, reason, result)
