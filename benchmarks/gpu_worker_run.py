"""One run of the real worker (`scripts/fast4gpu_boost_v2.py`), measured from outside.

What a run reports (`measure(...)`): its exit code, tokens/s (median of the metrics lines'
`tok_s` after the first step: the first holds the compile and warm-up), peak memory as the
worker itself reports it (`mem_gb`: torch.cuda.max_memory_allocated on CUDA, peak RSS on
the CPU) and as nvidia-smi sees the card (sampled every 0.5 s, the CUDA context and the
allocator's cache included), the `compile` event's seconds, and the time to the first
step (process start to the first metrics line: import, model build, compile, step 1).

`stop_after_steps` SIGKILLs the worker once its metrics line of that step is written: the
numbers are complete then, and a 1B run would otherwise spend ~10 s writing an 8.8 GB final
checkpoint that nothing here reads. The worker runs in its own process group, killed on
any exit of this module (a cut suite must not leave a worker holding the GPU).
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from launcher import child
from tests.support.worker_utils import read_jsonl, worker_command

# The worker started last and still running: killed by `kill_running()` on a signal.
_running: list[subprocess.Popen] = []


def kill_running() -> None:
    for proc in list(_running):
        if proc.poll() is None:
            child.kill_group(proc)
            proc.wait()


def nvidia_smi_used_mib(index: int = 0) -> float | None:
    """Memory in use on GPU `index` as nvidia-smi reports it, or None (absent, failing)."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        done = subprocess.run(["nvidia-smi", f"--id={index}", "--query-gpu=memory.used",
                               "--format=csv,noheader,nounits"], capture_output=True,
                              text=True, timeout=10)
        return float(done.stdout.strip().splitlines()[0]) if done.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return None


class SmiSampler:
    """The highest nvidia-smi memory.used while a run lasts (None without nvidia-smi)."""

    def __init__(self, interval_s: float = 0.5):
        self.interval_s, self.peak_mib = interval_s, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            used = nvidia_smi_used_mib()
            if used is None:
                return
            self.peak_mib = max(self.peak_mib or 0.0, used)
            self._stop.wait(self.interval_s)

    def __enter__(self) -> "SmiSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=15)


@dataclass
class WorkerRun:
    code: int | None                     # exit code; None: killed by us after its last step
    outcome: str                         # ok | oom | failed | timeout
    steps: int = 0                       # metrics lines seen (LOG_EVERY=1: steps done)
    tok_s: float | None = None
    mem_gb: float | None = None          # the worker's own peak (max_memory_allocated / RSS)
    smi_peak_mib: float | None = None
    compile_s: float | None = None
    compile_status: str | None = None
    graph_breaks: int | None = None      # torch's counts at the run's last compile event
    recompiles: int | None = None
    first_step_s: float | None = None    # process start -> first metrics line
    wall_s: float = 0.0
    ema_tf: list = field(default_factory=list)
    message: str | None = None           # why it failed (its oom/error event, or stderr)

    def to_dict(self) -> dict:
        return asdict(self)


def compile_fields(records: list[dict]) -> dict:
    """The first `compile` event's time and status (the first compiled step), and the
    graph breaks and recompiles of the last one (a `recompiled` event updates them)."""
    compiles = [r for r in records if r.get("type") == "event" and r.get("event") == "compile"]
    if not compiles:
        return {}
    return {"compile_s": compiles[0].get("seconds"), "compile_status": compiles[0].get("status"),
            "graph_breaks": compiles[-1].get("graph_breaks"),
            "recompiles": compiles[-1].get("recompiles")}


def _last_line(path: Path) -> str | None:
    lines = [s for s in path.read_text(errors="replace").splitlines() if s.strip()] \
        if path.exists() else []
    return lines[-1][:300] if lines else None


def measure(env: dict, run_dir: Path, timeout_s: float,
            stop_after_steps: int | None = None) -> WorkerRun:
    """Run the worker with `env` (its METRICS must be run_dir/metrics.jsonl, LOG_EVERY=1)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics = run_dir / "metrics.jsonl"
    log_path = run_dir / "worker.log"
    t0, t0_wall = time.monotonic(), time.time()
    killed_after_last = timed_out = False
    with open(log_path, "wb") as log, SmiSampler() as smi:
        proc = child.spawn(worker_command(), cwd=Path(__file__).resolve().parents[1], env=env,
                           stdout=log, stderr=subprocess.STDOUT)
        _running.append(proc)
        try:
            while proc.poll() is None:
                if time.monotonic() - t0 > timeout_s:
                    timed_out = True
                    break
                if stop_after_steps and sum(1 for r in read_jsonl(metrics)
                                            if r["type"] == "metrics") >= stop_after_steps:
                    killed_after_last = True
                    break
                time.sleep(0.2)
        finally:
            if proc.poll() is None:
                child.kill_group(proc)
            proc.wait()
            _running.remove(proc)
    records = read_jsonl(metrics)
    lines = [r for r in records if r["type"] == "metrics"]
    events = {r["event"]: r for r in records if r["type"] == "event"}
    start = events.get("start")
    run = WorkerRun(code=None if killed_after_last else proc.returncode, outcome="ok",
                    steps=len(lines), smi_peak_mib=smi.peak_mib, **compile_fields(records),
                    wall_s=time.monotonic() - t0, ema_tf=[r.get("ema_tf") for r in lines])
    if lines:
        run.first_step_s = lines[0]["ts"] - t0_wall
        later = [r["tok_s"] for r in lines[1:] if r.get("tok_s")]
        run.tok_s = statistics.median(later) if later else None
        run.mem_gb = max(r.get("mem_gb") or 0.0 for r in lines)
    if start is None and lines:
        run.message = "no start event"
    if timed_out:
        run.outcome, run.message = "timeout", f"killed after {timeout_s:.0f} s"
    elif "oom" in events or proc.returncode == 4:
        run.outcome = "oom"
        run.message = (events.get("oom") or {}).get("message") or _last_line(log_path)
    elif not killed_after_last and proc.returncode != 0:
        run.outcome = "failed"
        run.message = (events.get("error") or {}).get("message") or _last_line(log_path)
    return run
