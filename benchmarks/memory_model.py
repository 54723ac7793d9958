"""Memory per BATCH of the real training step, traced on the `meta` device (no memory used).

The invariant: every byte the step allocates is counted from the step itself, not from a
formula kept beside it. The real TrainStep pieces (forward under the stage's settings, the
loss, backward, clipping, the SGD step, the scheduled-sampling pass) run on meta tensors
under a dispatch mode that adds each new storage's bytes when an op creates it and takes
them off when it is freed, so its high-water mark is the step's peak of tensor memory:
weights, SGD momentum, gradients, the tensors autograd saves for backward, the carried
state, every transient (the chunked CE's pieces, the dense CE's logits), and the SS pass.
It does not count the allocator's rounding and caching, CUDA's context and kernels'
workspaces (cuBLAS, Triton), or what torch.compile fuses away: `--check-small` compares
the model with the measured peak of the `small` preset on this CPU. `largest_batch` is the
modelled largest BATCH for a card. Owner: the benchmarks (docs/BENCHMARKS.md, "Memory per
BATCH at 1B").

    python benchmarks/memory_model.py                    # the 1B table: 32 GB and 141 GB cards
    python benchmarks/memory_model.py --check-small      # the model against small on CPU
"""

from __future__ import annotations

import argparse
import functools
import random
import sys
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from fractus.config import PRESETS                                  # noqa: E402
from fractus.continuous_engine import ContinuousThoughtEngine       # noqa: E402
from fractus.nn import attention                                    # noqa: E402
from fractus.train.env import WorkerSettings                        # noqa: E402
from fractus.train.step import CLIP_NORM, SS_LOSS_WEIGHT, TrainStep  # noqa: E402

CARDS = {"RTX 5090 (32 GB)": 32e9, "H200 (141 GB)": 141e9}
GB = 1e9


class StorageTracker(TorchDispatchMode):
    """Live bytes of the storages created while active (and of those `adopt` names), and
    their high-water mark. A storage counts once, whatever views of it exist."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}

    def adopt(self, tensors) -> None:
        """Storages that exist before the step (weights, momentum, carried state)."""
        for t in tensors:
            self._count(t)

    def _count(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self._sizes:
            return
        self._sizes[key] = storage.nbytes()
        self.live += storage.nbytes()
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)

    def reset_peak(self) -> None:
        self.peak = self.live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._count(t)
        return out


@dataclass(frozen=True)
class StepMemory:
    batch: int
    weights: int          # bytes: parameters (tied weights once) and carried state
    momentum: int         # SGD momentum buffers
    peak: int             # the step's high-water mark, everything included

    @property
    def activations(self) -> int:
        """What the step adds on top of weights and momentum (gradients, saved tensors,
        transients, SS pass)."""
        return self.peak - self.weights - self.momentum


def _settings(batch: int, seq: int, stage_settings: dict) -> WorkerSettings:
    env = {"BATCH": str(batch), "SEQ": str(seq), "SS_RATE": "1", "BF16": "0",
           **{k: str(v) for k, v in stage_settings.items()
              if k in ("CE_CHUNK", "ACCUM")}}
    return WorkerSettings.from_env(env)


def run_step(trainer: TrainStep, batches, step: int) -> None:
    """The step's pieces without its host reads (a meta tensor has no value to read): each
    pass's forward, loss, backward; the SS pass after the TF pass's SGD step (ACCUM=1) or
    accumulated with it (ACCUM>1), as TrainStep does; clip and SGD step."""
    s = trainer.s
    accum = len(batches)
    if accum == 1:
        trainer.optimizer.zero_grad(set_to_none=True)
    for chunk, target in batches:
        ce, lb, sampler_state = trainer._forward(chunk, target, True, step)
        if accum == 1:
            trainer.optimizer.zero_grad(set_to_none=True)
        ((ce + s.lb_coef * lb) / accum).backward()
        if accum == 1:
            torch.nn.utils.clip_grad_norm_(trainer.params, CLIP_NORM)
            trainer.optimizer.step()
        mixed = trainer._mixed_chunk(chunk, sampler_state)
        del sampler_state, ce, lb
        ce2, lb2, _ = trainer._forward(mixed, target, False, step)
        if accum == 1:
            trainer.optimizer.zero_grad(set_to_none=True)
        ((SS_LOSS_WEIGHT * ce2 + s.lb_coef * lb2) / accum).backward()
        del ce2, lb2
        if accum == 1:
            torch.nn.utils.clip_grad_norm_(trainer.params, CLIP_NORM)
            trainer.optimizer.step()
    if accum > 1:
        torch.nn.utils.clip_grad_norm_(trainer.params, CLIP_NORM)
        trainer.optimizer.step()


def step_memory(preset: str, batch: int, seq: int, stage_settings: dict,
                device: str = "meta") -> StepMemory:
    """The steady step's memory at `batch` (the second step: momentum and the previous
    step's gradients exist, as in training)."""
    attention.set_attention_impl(stage_settings.get("FRACTUS_ATTN_IMPL", "chunked"))
    settings = _settings(batch, seq, stage_settings)
    dev = torch.device(device)
    with torch.device(dev):
        model = ContinuousThoughtEngine.from_config(PRESETS[preset])
    model.reset_thought(batch)
    model.set_gate_temperature(settings.gate_temp)
    optimizer = torch.optim.SGD(model.parameters(), lr=settings.lr, momentum=0.9)
    trainer = TrainStep(model, optimizer, settings, dev)
    vocab = PRESETS[preset].vocab_size
    random.seed(0)

    def batches():
        return [(torch.randint(0, vocab, (batch, seq), device=dev),
                 torch.randint(0, vocab, (batch, seq), device=dev))
                for _ in range(settings.accum)]
    run_step(trainer, batches(), 1)              # momentum and gradients now exist
    tracker = StorageTracker()
    params = {p.untyped_storage()._cdata: p for p in model.parameters()}.values()
    momentum = [state["momentum_buffer"] for state in optimizer.state.values()]
    weights = sum(p.untyped_storage().nbytes() for p in params) + \
        sum(t.untyped_storage().nbytes() for t in model.carry_state().values())
    data = batches()
    with tracker:
        tracker.adopt(list(params) + momentum + list(model.carry_state().values())
                      + [p.grad for p in params if p.grad is not None]
                      + [t for pair in data for t in pair])
        tracker.reset_peak()
        run_step(trainer, data, 2)
    attention.set_attention_impl(None)
    return StepMemory(batch=batch, weights=weights,
                      momentum=sum(t.untyped_storage().nbytes() for t in momentum),
                      peak=tracker.peak)


@functools.lru_cache(maxsize=None)
def _peak(preset: str, batch: int, seq: int, settings: tuple) -> int:
    return step_memory(preset, batch, seq, dict(settings)).peak


def modelled_peak(preset: str, batch: int, seq: int, stage_settings: dict) -> int:
    """step_memory's peak, each (preset, batch, seq, settings) traced once."""
    return _peak(preset, batch, seq, tuple(sorted(stage_settings.items())))


def largest_batch(preset: str, seq: int, stage_settings: dict, capacity: float,
                  headroom: float = 0.1, limit: int = 4096) -> int:
    """The largest BATCH whose modelled peak leaves `headroom` of `capacity` free (0: none
    fits). The peak grows linearly with BATCH past the fixed terms: the line through two
    traced batches predicts it, then traced batches around the prediction decide."""
    budget = capacity * (1 - headroom)

    def fits(b: int) -> bool:
        return modelled_peak(preset, b, seq, stage_settings) <= budget
    if not fits(1):
        return 0
    p16, p32 = (modelled_peak(preset, b, seq, stage_settings) for b in (16, 32))
    per_row = max((p32 - p16) / 16, 1.0)
    b = int(min(max(16 + (budget - p16) // per_row, 1), limit))
    while b > 1 and not fits(b):
        b -= 1
    while b < limit and fits(b + 1):
        b += 1
    return b


def _proc_status(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def measured_cpu_peak(preset: str, batch: int, seq: int, stage_settings: dict) -> int:
    """The real step 2 (TrainStep itself) on this CPU, in bytes: the tensors that exist
    before it (weights, carried state, momentum, the previous step's gradients) plus how far
    the resident set rose above its level before the step (VmHWM, reset just before)."""
    attention.set_attention_impl(stage_settings.get("FRACTUS_ATTN_IMPL", "chunked"))
    settings = _settings(batch, seq, stage_settings)
    torch.manual_seed(0)
    random.seed(0)
    model = ContinuousThoughtEngine.from_config(PRESETS[preset])
    model.reset_thought(batch)
    model.set_gate_temperature(settings.gate_temp)
    optimizer = torch.optim.SGD(model.parameters(), lr=settings.lr, momentum=0.9)
    trainer = TrainStep(model, optimizer, settings, torch.device("cpu"))
    vocab = PRESETS[preset].vocab_size

    def batches():
        return [(torch.randint(0, vocab, (batch, seq)), torch.randint(0, vocab, (batch, seq)))
                for _ in range(settings.accum)]
    trainer(batches(), 1)
    data = batches()
    before = {p.untyped_storage()._cdata: p.untyped_storage().nbytes()
              for p in [*model.parameters(), *model.carry_state().values(),
                        *(p.grad for p in model.parameters() if p.grad is not None),
                        *(s["momentum_buffer"] for s in optimizer.state.values())]}
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                      # the peak RSS starts again from the current one
    rss = _proc_status("VmRSS")
    trainer(data, 2)
    rise = _proc_status("VmHWM") - rss
    attention.set_attention_impl(None)
    return sum(before.values()) + rise


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="1b")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batches", default="1,4,8,16,32")
    parser.add_argument("--headroom", type=float, default=0.1)
    parser.add_argument("--check-small", action="store_true",
                        help="the model against the measured peak of the small preset on CPU")
    args = parser.parse_args(argv)
    from launcher.config.stages import load_stages
    from launcher.config.podconfig import DEFAULT_MANIFESTS
    stages = load_stages(DEFAULT_MANIFESTS / "stages.yaml")
    if args.check_small:
        torch.set_num_threads(1)
        print("small preset, SEQ 128, SS pass on: modelled peak vs measured on this CPU")
        for number in (1, 2):
            for batch in (4, 16):
                settings = stages[number].settings
                model = modelled_peak("small", batch, 128, settings)
                real = measured_cpu_peak("small", batch, 128, settings)
                print(f"stage {number} B={batch:>3}: model {model / GB:.3f} GB, measured "
                      f"{real / GB:.3f} GB, measured/model {real / model:.2f}")
        return 0
    print(f"preset {args.model}, SEQ {args.seq}, SS pass on, float32 tensors "
          f"(bf16 autocast adds casts, see docs/BENCHMARKS.md)")
    print(f"{'stage':>5} {'settings':<34} " + " ".join(f"{'B=' + b:>8}"
                                                       for b in args.batches.split(","))
          + "  largest B: " + ", ".join(CARDS))
    for number, stage in sorted(stages.items()):
        settings = stage.settings
        peaks = [modelled_peak(args.model, int(b), args.seq, settings) / GB
                 for b in args.batches.split(",")]
        fits = [largest_batch(args.model, args.seq, settings, cap, args.headroom)
                for cap in CARDS.values()]
        label = (f"{settings.get('FRACTUS_ATTN_IMPL')} CE_CHUNK={settings.get('CE_CHUNK')} "
                 f"ACCUM={settings.get('ACCUM')}")
        print(f"{number:>5} {label:<34} " + " ".join(f"{p:>7.1f}G" for p in peaks)
              + "  " + ", ".join(str(f) for f in fits))
    return 0


if __name__ == "__main__":
    sys.exit(main())
