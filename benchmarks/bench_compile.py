"""Compile seconds and steady step time of the training step, inductor against eager, side by
side per compiled stage's settings on the CPU (the band itself is tests/test_compile_band.py's).

For each setting one process builds two identical trainers (`common.training_setup`, the same
seed), compiles one, then runs them step by step in turn on the same tokens: both see the
same load, so the ratio is the number to read. Step 1 of the compiled one is the compile.

    PYTHONPATH=. python benchmarks/bench_compile.py --preset tiny --batch 4 --seq 128 --steps 8
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from benchmarks import common

SETTINGS = {"stage4": {"CE_CHUNK": "2048", "SS_RATE": "0", "ACCUM": "1"},
            "stage5-ss": {"CE_CHUNK": "2048", "SS_RATE": "1", "ACCUM": "2"},
            "dense-ss-accum2": {"CE_CHUNK": "0", "SS_RATE": "1", "ACCUM": "2"}}


def cell(name: str, preset: str, batch: int, seq: int, steps: int, threads: int) -> dict:
    import torch

    from fractus.nn import attention
    from fractus.train.env import WorkerSettings
    from fractus.train.step import TrainStep
    attention.set_attention_impl("chunked")
    settings = WorkerSettings.from_env({"BATCH": str(batch), "SEQ": str(seq), **SETTINGS[name]})
    trainers = {}
    for mode in ("compiled", "eager"):
        cfg, model, optimizer = common.training_setup(preset, batch, threads)
        trainers[mode] = TrainStep(model, optimizer, settings, torch.device("cpu"))
    trainers["compiled"].compile()
    tokens = torch.Generator().manual_seed(1)
    seconds = {mode: [] for mode in trainers}
    for step in range(1, steps + 1):
        batches = [(torch.randint(0, cfg.vocab_size, (batch, seq), generator=tokens),
                    torch.randint(0, cfg.vocab_size, (batch, seq), generator=tokens))
                   for _ in range(settings.accum)]
        for mode, trainer in trainers.items():
            random.seed(step)               # the same SS coin for both
            start = time.perf_counter()
            trainer(batches, step)
            seconds[mode].append(time.perf_counter() - start)
    compiled, eager = (statistics.median(seconds[m][1:]) for m in ("compiled", "eager"))
    return {"setting": name, "compile_s": seconds["compiled"][0], "compiled_step_s": compiled,
            "eager_step_s": eager, "speedup": eager / compiled,
            "graphs": trainers["compiled"].compile_counts()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1200)
    args = parser.parse_args()
    rows = []
    for name in SETTINGS:
        r = common.run_cell("benchmarks.bench_compile", "cell",
                            dict(name=name, preset=args.preset, batch=args.batch, seq=args.seq,
                                 steps=args.steps, threads=args.threads), args.timeout)
        rows.append([name, common.fmt(r.get("compile_s")),
                     common.fmt(r.get("compiled_step_s"), ".3f"),
                     common.fmt(r.get("eager_step_s"), ".3f"), common.fmt(r.get("speedup"), ".2f"),
                     r.get("graphs", r.get("error")), r.get("load_avg")])
    print(common.markdown_table(["setting", "compile s", "compiled step s", "eager step s",
                                 "eager / compiled", "compile counts", "load avg"], rows))


if __name__ == "__main__":
    main()
