"""Tokens/s of one engine training step (TF pass, backward, clip, SGD), side by side.

Modes, each run in its own subprocess on the same machine in one invocation:
- `reference`: the reference implementation's code paths inside this engine: the
  masked-matmul attention (`einsum`), per-token expert dispatch with gathered weights,
  and the dense CE over materialised (B, C, V) logits;
- `dense`: this engine's kernels (--impl, row dispatch of the experts) with the same dense
  CE as the reference: `tick_chunk_train` logits, then `F.cross_entropy` (the worker's
  CE_CHUNK=0 step);
- `fast`: this engine's kernels with the fused chunked CE (`tick_chunk_train_ce`).
All compute the same function (tests/test_engine*.py prove it). `--rounds N` runs the modes
N times, alternating processes, and gives each round's ratios to the reference of that
round: on a shared machine only ratios measured side by side mean anything, so every row
carries the 1-minute load average around it.

Each `dense`/`fast` process also times the checks that stay on the hot path against its own
step: the token-id range check (`check_token_ids`, run once per chunk by the engine on the
host-side ids, twice with the fused CE) and the worker's finiteness check of the step's
scalars (`fractus.train.step.read_finite`, one host read per optimizer step).

    python benchmarks/bench_engine.py --modes reference,dense,fast --impl chunked --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import common  # noqa: E402


def run_mode(mode: str, preset: str, batch: int, seq: int, impl: str, steps: int, warmup: int,
             ce_chunk: int, threads: int) -> dict:
    import os

    import torch
    import torch.nn.functional as F

    from fractus.continuous_engine import check_token_ids
    from fractus.nn.attention import set_attention_impl
    from fractus.train.step import read_finite

    cfg, model, opt = common.training_setup(preset, batch, threads)
    reference = mode == "reference"
    set_attention_impl("einsum" if reference else impl)
    for blk in model.blocks:
        blk.moe.dispatch = "token" if reference else "auto"
    gen = torch.Generator().manual_seed(1)

    def step():
        data = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=gen)
        obs, target = data[:, :-1], data[:, 1:]
        if mode == "fast":
            ce, lb = model.tick_chunk_train_ce(obs, target, ce_chunk)
        else:  # reference and dense: logits, then the caller's dense CE
            logits, lb = model.tick_chunk_train(obs)
            ce = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), target.reshape(-1))
        loss = ce + 0.02 * lb
        opt.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return obs, {"loss": loss, "tf": ce, "lb": lb}, norm

    for _ in range(warmup):
        step()
    load_before = os.getloadavg()[0]
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        obs, watched, norm = step()
        times.append(time.perf_counter() - t0)
    median = statistics.median(times)
    result = {"mode": mode, "impl": "einsum" if reference else impl, "preset": preset,
              "batch": batch, "seq": seq, "step_s": median, "tok_s": batch * seq / median,
              "threads": torch.get_num_threads(),
              "load_avg": [round(load_before, 2), round(os.getloadavg()[0], 2)]}
    if not reference:
        # Each check's median over many calls, as a share of this process's median step.
        id_checks = 2 if mode == "fast" else 1  # the fused CE also checks the targets
        id_s = common.median_ms(lambda: check_token_ids(obs, cfg.vocab_size), 200, 20) / 1e3
        finite_s = common.median_ms(lambda: read_finite(0, watched, norm), 200, 20) / 1e3
        result["checks_share"] = (id_checks * id_s + finite_s) / median
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--impl", default="cumsum", help="attention kernel of the fast mode")
    ap.add_argument("--modes", default="reference,dense,fast")
    ap.add_argument("--rounds", type=int, default=1, help="alternate the modes this many times")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--ce-chunk", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one mode in this process
    args = ap.parse_args()
    settings = dict(preset=args.preset, batch=args.batch, seq=args.seq, impl=args.impl, steps=args.steps,
                  warmup=args.warmup, ce_chunk=args.ce_chunk, threads=args.threads)
    if args.one:
        print(json.dumps(run_mode(args.one, **settings)))
        return

    results = []
    for round_no in range(1, args.rounds + 1):
        for mode in args.modes.split(","):
            cmd = [sys.executable, __file__, "--one", mode] + [
                a for k, v in settings.items() for a in (f"--{k.replace('_', '-')}", str(v))]
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
            if proc.returncode != 0:
                result = {"mode": mode, "error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
            else:
                result = json.loads(proc.stdout.strip().splitlines()[-1])
            results.append(dict(result, round=round_no))
    print(report(results))
    if args.json:
        common.write_json_atomic(args.json, results)


def report(results: list) -> str:
    """One row per process; each mode's tokens/s over the reference's of the same round."""
    reference = {r["round"]: r for r in results if r["mode"] == "reference" and "error" not in r}
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["round"], r["mode"], "error: " + r["error"], "", "", "", "", "", ""])
            continue
        ref = reference.get(r["round"])
        ratio = f"{r['tok_s'] / ref['tok_s']:.2f}x" if ref and r is not ref else ""
        checks = common.fmt(r.get("checks_share") and 100 * r["checks_share"], ".2g")
        rows.append([r["round"], r["mode"], r["impl"], r["threads"], f"{r['step_s']:.3f}",
                     f"{r['tok_s']:.0f}", ratio, checks, "-".join(map(str, r["load_avg"]))])
    return common.markdown_table(["round", "mode", "attention", "threads", "step (s)", "tok/s",
                                  "/ reference", "checks % of step", "load avg"], rows)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
