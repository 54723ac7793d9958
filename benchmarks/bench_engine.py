"""Tokens/s of one engine training step (TF pass, backward, clip, SGD), side by side.

Modes, each run in its own subprocess on the same machine in one invocation:
- `reference`: the reference implementation's code paths inside this engine: the
  masked-matmul attention (`einsum`), per-token expert dispatch with gathered weights,
  and the dense CE over materialised (B, C, V) logits;
- `fast`: the default CPU kernel (`cumsum`) or the one given by --impl, row dispatch of
  the experts, fused chunked CE (`tick_chunk_train_ce`).
Both compute the same function (tests/test_engine*.py prove it).

    python benchmarks/bench_engine.py --preset small --batch 8 --seq 128
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
    import torch
    import torch.nn.functional as F

    from fractus.nn.attention import set_attention_impl

    cfg, model, opt = common.training_setup(preset, batch, threads)
    reference = mode == "reference"
    set_attention_impl("einsum" if reference else impl)
    for blk in model.blocks:
        blk.moe.dispatch = "token" if reference else "auto"
    gen = torch.Generator().manual_seed(1)

    def step():
        data = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=gen)
        obs, target = data[:, :-1], data[:, 1:]
        if reference:
            logits, lb = model.tick_chunk_train(obs)
            loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), target.reshape(-1)) + 0.02 * lb
        else:
            ce, lb = model.tick_chunk_train_ce(obs, target, ce_chunk)
            loss = ce + 0.02 * lb
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    median = statistics.median(times)
    return {"mode": mode, "impl": "einsum" if reference else impl, "preset": preset, "batch": batch,
            "seq": seq, "step_s": median, "tok_s": batch * seq / median, "threads": torch.get_num_threads()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--impl", default="cumsum", help="attention kernel of the fast mode")
    ap.add_argument("--modes", default="reference,fast")
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
    for mode in args.modes.split(","):
        cmd = [sys.executable, __file__, "--one", mode] + [
            a for k, v in settings.items() for a in (f"--{k.replace('_', '-')}", str(v))]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        if proc.returncode != 0:
            results.append({"mode": mode, "error": (proc.stderr.strip().splitlines() or ["?"])[-1]})
        else:
            results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    print("| mode | attention | preset | B x SEQ | step (s) | tok/s |\n|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['mode']} | error: {r['error']} | | | | |")
        else:
            print(f"| {r['mode']} | {r['impl']} | {r['preset']} | {r['batch']} x {r['seq']} "
                  f"| {r['step_s']:.3f} | {r['tok_s']:.0f} |")
    ok = {r["mode"]: r for r in results if "error" not in r}
    if "reference" in ok and "fast" in ok:
        print(f"\nfast / reference tokens/s: {ok['fast']['tok_s'] / ok['reference']['tok_s']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
