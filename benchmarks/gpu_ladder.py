"""Part 2 of benchmarks/gpu_suite.sh: the user's stage ladder through the real worker.

For each stage of the shipped stages.yaml (launcher/config/defaults/), its own settings
(BATCH, CE_CHUNK, FRACTUS_ATTN_IMPL, COMPILE, ACCUM) on a synthetic shard of the preset's
vocabulary, a fresh model (same SEED for every stage), `--steps` steps
(benchmarks/gpu_worker_run.py says what each run reports). MFU = tok/s x FLOPs per token /
`--peak-tflops`; FLOPs per token = 6 x the parameters one token uses (the dense ones plus
top_k of n_experts experts; the linear-attention and ODE terms are not counted): 1.14 GFLOP
at the 1B preset.

Then:
- stage 1 against the reference (v1) loop (tests/support/v1_step.py) on the same device,
  the same fresh model, seed and tokens: ema_tf per step, the largest relative difference.
- the largest BATCH that fits at stages 4-5 with `--headroom` of the card left: the first
  try is the memory model's largest BATCH for the card (benchmarks/memory_model.py
  `largest_batch`, the step traced on the meta device; the stage's BATCH when the card's
  size is unknown), then doubling up from it to `--fit-max` while it fits, or halving down
  while it does not, then bisection; each try a real worker in its own process (an
  out-of-memory exit is a result, not a crash) for 2 steps with SS_RATE=1 (the
  scheduled-sampling pass is the step's peak) and COMPILE=0 (a compile per try would not
  fit the time; the eager step is the larger one); the batch found is then run with
  stages 4 and 5's own settings, compile included, to confirm it.

The results file is rewritten after every run, so a suite that cuts this part keeps what
it had; SIGTERM kills the running worker and records the cut.

    python -m benchmarks.gpu_ladder --preset 1b --device cuda --json OUT/ladder.json
    python -m benchmarks.gpu_ladder --preset tiny --device cpu --steps 4 --no-compile \
        --compile-stage 4 ...
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import common  # noqa: E402
from benchmarks.gpu_worker_run import kill_running, measure  # noqa: E402

H200_BF16_DENSE_TFLOPS = 989.0   # the data sheet's dense bf16 peak (no sparsity)
FIT_STAGES = (4, 5)


def flops_per_token(preset: str) -> dict:
    """6 x the parameters a token uses: all but the experts' share it is not routed to."""
    import torch
    from fractus.config import load_model_config
    from fractus.continuous_engine import ContinuousThoughtEngine
    cfg = load_model_config(preset)
    with torch.device("meta"):
        model = ContinuousThoughtEngine.from_config(cfg)
    total = expert = 0
    for name, p in model.named_parameters():
        total += p.numel()
        if ".moe." in name and p.dim() >= 2 and cfg.n_experts in p.shape[:2] \
                and "gate" not in name:
            expert += p.numel()
    active = total - expert * (1 - cfg.top_k / cfg.n_experts)
    return {"params": total, "active_params": int(active), "flops_per_token": 6 * active}


def worker_env(work: Path, args, settings: dict, name: str, **extra) -> dict:
    """The worker's environment for one run: the stage's settings, then `extra`."""
    from tests.support import worker_utils
    run_dir = work / name
    values = {"SHARD": work / "shard.npy", "MODEL": args.preset, "DEVICE": args.device,
              "SEQ": args.seq, "SEED": 42, "LOG_EVERY": 1, "SAVE_EVERY": 0, "SAVE_KEEP": 1,
              "MAX_STEPS": args.steps, "OMP_NUM_THREADS": args.threads,
              "MKL_NUM_THREADS": args.threads, "CKPT_OUT": run_dir / "fractus_1b_gpu0.pt",
              "METRICS": run_dir / "metrics.jsonl", **settings,
              **({"COMPILE": "0"} if args.no_compile else {}), **extra}
    return worker_utils.worker_env(run_dir, **values)


class Results:
    """The JSON results file, rewritten after every piece."""

    def __init__(self, path: Path | None, header: dict):
        self.path, self.data = path, {**header, "stages": {}, "reference": None, "fit": {}}

    def save(self) -> None:
        if self.path is not None:
            common.write_json_atomic(self.path, self.data)


def run_ladder(args, work: Path, results: Results, stages: dict) -> None:
    flops, peak = results.data["flops_per_token"], args.peak_tflops * 1e12
    for number in sorted(stages):
        stage = stages[number]
        env = worker_env(work, args, stage.settings, f"stage{number}",
                         **({"COMPILE": "1"} if number == args.compile_stage else {}))
        keep = number == 1      # stage 1's checkpoint: the reference comparison, the AR probe
        run = measure(env, work / f"stage{number}", args.run_timeout,
                      stop_after_steps=None if keep else args.steps)
        row = {"name": stage.name, "settings": env_settings(env), **run.to_dict()}
        row["mfu"] = run.tok_s * flops / peak if run.tok_s else None
        results.data["stages"][str(number)] = row
        results.save()
        print(f"stage {number}: {run.outcome}, {fmt(run.tok_s)} tok/s, mem {fmt(run.mem_gb)} GB",
              flush=True)


def env_settings(env: dict) -> dict:
    return {k: env[k] for k in ("BATCH", "CE_CHUNK", "FRACTUS_ATTN_IMPL", "COMPILE", "ACCUM",
                                "SEQ", "MODEL", "DEVICE") if k in env}


def fmt(value) -> str:
    return "-" if value is None else f"{value:.3g}"


# ---- the reference loop (a cell: its own process, the device to itself) ----------------
def reference_ema(env: dict, steps: int) -> dict:
    """The v1 loop from the worker's own fresh start: same seed, model, optimizer, tokens."""
    import numpy as np
    import torch
    from fractus.config import load_model_config
    from fractus.continuous_engine import ContinuousThoughtEngine
    from fractus.train.env import WorkerSettings
    from tests.support.v1_step import V1Settings, reference_loop
    s = WorkerSettings.from_env(env)
    device = torch.device(s.device or "cpu")
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    torch.manual_seed(s.effective_seed)      # the worker's fresh start, in its order
    random.seed(s.effective_seed)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    model = ContinuousThoughtEngine(**load_model_config(s.model).to_dict())
    model.reset_thought(s.batch)
    model = model.to(device)
    model.set_gate_temperature(s.gate_temp)
    opt = torch.optim.SGD(model.parameters(), lr=s.lr, momentum=0.9)
    tokens = torch.from_numpy(np.load(s.shard_path, mmap_mode="r")[
        :steps * s.tokens_per_batch + 1].astype(np.int64))
    t0 = time.perf_counter()
    run = reference_loop(model, opt, tokens, 0, steps,
                         V1Settings(s.batch, s.seq, s.lr, s.ss_rate, s.ss_prob, s.lb_coef), device)
    return {"ema_tf": run.ema_tf_per_step, "ss_passes": run.ss_passes,
            "seconds": time.perf_counter() - t0}


def compare_reference(args, work: Path, results: Results, stages: dict) -> None:
    env = worker_env(work, args, stages[1].settings, "stage1")
    ref = common.run_cell("benchmarks.gpu_ladder", "reference_ema",
                          {"env": env, "steps": args.steps}, args.run_timeout, env=None)
    worker = results.data["stages"].get("1", {}).get("ema_tf", [])
    out = {"steps": args.steps, **ref, "worker_ema_tf": worker}
    pairs = [(w, r) for w, r in zip(worker, ref.get("ema_tf", [])) if w is not None]
    if pairs:
        out["max_rel_diff"] = max(abs(w - r) / max(abs(r), 1e-30) for w, r in pairs)
        out["equal"] = all(w == r for w, r in pairs)
    results.data["reference"] = out
    results.save()
    print(f"stage 1 vs reference: max rel ema_tf diff {fmt(out.get('max_rel_diff'))}"
          + (f" ({ref['error']})" if "error" in ref else ""), flush=True)


# ---- the largest batch that fits -------------------------------------------------------
def capacity_bytes(device: str) -> float | None:
    """The card's memory (nvidia-smi: this process never touches CUDA) or the host's RAM."""
    import shutil
    import subprocess
    if device.startswith("cuda"):
        if shutil.which("nvidia-smi") is None:
            return None
        done = subprocess.run(["nvidia-smi", "--id=0", "--query-gpu=memory.total",
                               "--format=csv,noheader,nounits"], capture_output=True, text=True,
                              timeout=10)
        try:
            return float(done.stdout.split()[0]) * 2**20
        except (ValueError, IndexError):
            return None
    import psutil
    return float(psutil.virtual_memory().total)


def model_start(args, settings: dict, capacity: float | None) -> int | None:
    """The memory model's largest BATCH for the card at the fit probe's settings (None:
    the card's size is unknown, or the model did not run)."""
    if capacity is None:
        return None
    from benchmarks.memory_model import largest_batch
    try:
        return largest_batch(args.preset, args.seq, settings, capacity, args.headroom,
                             limit=args.fit_max)
    except Exception as e:          # the search goes on from the stage's BATCH
        print(f"memory model: {type(e).__name__}: {e}", flush=True)
        return None


def fit_search(args, work: Path, results: Results, stages: dict, deadline: float) -> None:
    capacity = capacity_bytes(args.device)
    limit = None if capacity is None else capacity * (1 - args.headroom)
    stage = stages[FIT_STAGES[0]]
    fit = {"capacity_gb": capacity and capacity / 1e9, "headroom": args.headroom,
           "limit_gb": limit and limit / 1e9, "probe": "2 steps, SS_RATE=1, COMPILE=0",
           "tries": [], "batch": None, "cut": None}
    results.data["fit"] = fit

    def fits(batch: int) -> bool:
        env = worker_env(work, args, {**stage.settings, "COMPILE": "0"}, f"fit{batch}",
                         BATCH=batch, SS_RATE=1, MAX_STEPS=2)
        run = measure(env, work / f"fit{batch}", args.run_timeout, stop_after_steps=2)
        ok = run.outcome == "ok" and run.steps >= 2 and (
            limit is None or (run.mem_gb or 0) * 1e9 <= limit)
        fit["tries"].append({"batch": batch, "fits": ok, "outcome": run.outcome,
                             "mem_gb": run.mem_gb, "smi_peak_mib": run.smi_peak_mib,
                             "message": run.message})
        results.save()
        print(f"fit BATCH {batch}: {'fits' if ok else run.outcome}, mem {fmt(run.mem_gb)} GB",
              flush=True)
        return ok

    start = model_start(args, stage.settings, capacity)
    fit["model_batch"] = start
    good, bad = None, None
    batch = start if start is not None else int(stage.settings.get("BATCH", 4))
    batch = max(min(batch, args.fit_max), 1)
    while batch <= args.fit_max and time.monotonic() < deadline:     # doubling up
        if not fits(batch):
            bad = batch
            break
        good, batch = batch, batch * 2
    while good is None and bad is not None and bad > 1 \
            and time.monotonic() < deadline:                        # halving down
        batch = bad // 2
        good, bad = (batch, bad) if fits(batch) else (None, batch)
    while good is not None and bad is not None and bad - good > 1 \
            and time.monotonic() < deadline:                        # bisection
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    fit["batch"] = good
    if time.monotonic() >= deadline:
        fit["cut"] = "time: the batch found is a lower bound"
    results.save()
    if good is None:
        return
    fit["confirm"] = {}
    for number in FIT_STAGES:            # the stages' own settings, compile included
        if time.monotonic() >= deadline:
            break
        env = worker_env(work, args, stages[number].settings, f"confirm{number}",
                         BATCH=good, MAX_STEPS=3)
        run = measure(env, work / f"confirm{number}", args.run_timeout, stop_after_steps=3)
        fit["confirm"][str(number)] = {k: v for k, v in run.to_dict().items() if k != "ema_tf"}
        results.save()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="1b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--threads", type=int, default=1, help="OMP threads per worker (CPU)")
    ap.add_argument("--no-compile", action="store_true", help="COMPILE=0 everywhere (CPU)")
    ap.add_argument("--compile-stage", type=int,
                    help="this stage's run compiles even with --no-compile (the CPU's dry run)")
    ap.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_TFLOPS)
    ap.add_argument("--headroom", type=float, default=0.10)
    ap.add_argument("--fit-max", type=int, default=256)
    ap.add_argument("--fit-seconds", type=float, default=150, help="time for the fit search")
    ap.add_argument("--run-timeout", type=float, default=150, help="per worker run")
    ap.add_argument("--work", type=Path, help="scratch folder (kept: shard, stage-1 checkpoint)")
    ap.add_argument("--stages", type=Path, default=REPO / "launcher" / "config" / "defaults" / "stages.yaml")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    from fractus.config import load_model_config
    from launcher.config.stages import load_stages
    from tests.support.worker_utils import write_synth_shard
    stages = load_stages(args.stages)
    work = args.work or Path(tempfile.mkdtemp(prefix="gpu-ladder-"))
    work.mkdir(parents=True, exist_ok=True)
    results = Results(args.json, {"preset": args.preset, "device": args.device, "seq": args.seq,
                                  "steps": args.steps, "peak_tflops": args.peak_tflops,
                                  "compile_forced_off": args.no_compile,
                                  "compile_stage": args.compile_stage, "work": str(work),
                                  "cut": None, **flops_per_token(args.preset)})

    def cut(signum, _frame):
        kill_running()
        results.data["cut"] = f"signal {signal.Signals(signum).name}"
        results.save()
        os._exit(124)
    signal.signal(signal.SIGTERM, cut)

    batch_max = max(int(s.settings.get("BATCH", 4)) * int(s.settings.get("ACCUM", 1))
                    for s in stages.values())
    tokens = (args.steps + 2) * max(batch_max, args.fit_max) * args.seq + 1
    write_synth_shard(work / "shard.npy", tokens=tokens, vocab=load_model_config(args.preset).vocab_size)
    run_ladder(args, work, results, stages)
    compare_reference(args, work, results, stages)
    fit_search(args, work, results, stages, time.monotonic() + args.fit_seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
