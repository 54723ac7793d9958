"""Small helpers shared by the benchmark scripts.

- `run_cell(module, func_name, kwargs, timeout)`: run one benchmark cell, `module.func_name(
  **kwargs) -> dict`, in a fresh Python process, so a crash, an out-of-memory kill or a timeout
  fills that cell with an error instead of ending the whole table, and each cell's peak RSS is
  its own. The child reports its result as one JSON line on stdout.
- `time_ms(fn, repeats, warmup, sync)` / `median_ms(...)`: wall times of `fn()` after warm-up.
- `markdown_table(headers, rows)` and `fmt(value, spec)`: print results.
- `write_json_atomic(path, obj)`: results file written via temp file + fsync + os.replace.
- `training_setup(preset, batch, threads)`: (config, model, SGD) as the worker builds them,
  for the benchmarks that time bare training steps.

Scripts import this as `from benchmarks import common` with the repository root on sys.path
(the children get it through PYTHONPATH).
"""

from __future__ import annotations

import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
RESULT_MARKER = "@@BENCH-RESULT@@ "  # prefixes the child's JSON line, whatever else it prints


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, in MiB (ru_maxrss: KiB on Linux)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def _child_main() -> None:
    """Entry point of the cell process: argv[1] holds {"module", "func", "kwargs"} as JSON."""
    import importlib

    spec = json.loads(sys.argv[1])
    func = getattr(importlib.import_module(spec["module"]), spec["func"])
    base = peak_rss_mb()  # after the imports, before the cell allocates anything
    load_before = os.getloadavg()[0]
    result = dict(func(**spec["kwargs"]))
    # The 1-minute load average around the cell: timings on a shared machine need it.
    result.update(peak_rss_mb=peak_rss_mb(), base_rss_mb=base,
                  load_avg=[round(load_before, 2), round(os.getloadavg()[0], 2)])
    print(RESULT_MARKER + json.dumps(result), flush=True)


def _describe_failure(returncode: int, stderr: str) -> str:
    if returncode < 0:
        name = signal.Signals(-returncode).name if -returncode in signal.valid_signals() else "?"
        hint = " (likely out of memory)" if -returncode == signal.SIGKILL else ""
        return f"killed by {name}{hint}"
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    last = lines[-1] if lines else "no output"
    return f"exit {returncode}: {last[:160]}"


def run_cell(module: str, func_name: str, kwargs: dict, timeout: float,
             env: Optional[dict] = None) -> dict:
    """Run `module.func_name(**kwargs)` in its own process and return its result dict.

    The result gains `peak_rss_mb` (the child's lifetime peak RSS), `base_rss_mb` (its peak
    just before the call, i.e. interpreter + imports) and `load_avg` (the machine's 1-minute
    load average before and after the call). On a crash, kill or timeout the result is
    `{"error": "<one line>"}` instead. `kwargs` must be JSON-serialisable; `env` adds variables.
    """
    child_env = dict(os.environ, **(env or {}))
    child_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO), child_env.get("PYTHONPATH", "")) if p)
    spec = json.dumps({"module": module, "func": func_name, "kwargs": kwargs})
    command = [sys.executable, "-c", "from benchmarks.common import _child_main; _child_main()",
               spec]
    try:
        done = subprocess.run(command, cwd=REPO, env=child_env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout:.0f} s"}
    if done.returncode != 0:
        return {"error": _describe_failure(done.returncode, done.stderr)}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(RESULT_MARKER):
            return json.loads(line[len(RESULT_MARKER):])
    return {"error": "the cell printed no result"}


def time_ms(fn: Callable[[], object], repeats: int, warmup: int = 1,
            sync: Optional[Callable[[], None]] = None) -> list:
    """Wall times of `fn()` in milliseconds, `repeats` runs after `warmup` untimed ones.

    `sync` (e.g. torch.cuda.synchronize) is called before starting and stopping each clock, so
    asynchronous device work is counted where it belongs.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    sync = sync or (lambda: None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def median_ms(fn: Callable[[], object], repeats: int, warmup: int = 1,
              sync: Optional[Callable[[], None]] = None) -> float:
    """Median of `time_ms(fn, repeats, warmup, sync)`."""
    return statistics.median(time_ms(fn, repeats, warmup, sync))


def fmt(value: object, spec: str = ".1f") -> str:
    """Format a number for a table; None or a missing value becomes an empty cell."""
    if value is None:
        return ""
    return format(value, spec) if isinstance(value, (int, float)) else str(value)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub markdown table; cells are converted with str() ('|' escaped)."""
    def line(cells):
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    return "\n".join([line(headers), line(["---"] * len(headers))] + [line(r) for r in rows])


def write_json_atomic(path: os.PathLike, obj: object) -> None:
    """Write JSON to `path` atomically: temp file in the same folder, fsync, os.replace."""
    from launcher.files import atomic_write_text  # one atomic writer (temp, fsync, rename)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(obj, indent=2) + "\n")


def training_setup(preset: str, batch: int, threads: int):
    """(config, model, optimizer) as a worker starts them: seed 0, gate temperature 2.5,
    carried state for `batch` rows, SGD with momentum. `threads` > 0 pins torch's threads."""
    import torch

    from fractus.config import load_model_config
    from fractus.continuous_engine import ContinuousThoughtEngine
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    cfg = load_model_config(preset)
    model = ContinuousThoughtEngine.from_config(cfg)
    model.set_gate_temperature(2.5)
    model.reset_thought(batch)
    return cfg, model, torch.optim.SGD(model.parameters(), lr=7e-4, momentum=0.9)
