"""Merge rounds, quality: does an outer step on the workers' mean help, at equal tokens?

Owner: the merge-rounds work (launcher/hub's outer step). Invariant: the three arms train the same
workers on the same tokens with the same per-worker RNG streams; they differ only in what happens
at a round's boundary, so any difference in held-out loss is the merge's.

Setup, all in one process on the CPU: one fixed random Markov chain (fractus.data.markov_chain)
over a small vocabulary; worker i trains on its own walk of it (shard i), a further walk is the
held-out slice nobody trains on. The workers start from one shared initial model (a pod's GPUs
start from one brain), run the worker's own step (fractus.train.step.TrainStep: the reference
TF pass plus the scheduled-sampling pass, SGD with momentum 0.9, clip 1.0) on an engine smaller
than `tiny` (EngineConfig below), and each keeps its own optimizer state, RNG (python `random`
and torch's, swapped in around its steps), data position and carried state across rounds. A
round every `steps` optimizer steps per worker:
- `none`: no round; the held-out loss of the plain mean of the workers' weights, and the mean
  of each worker's own held-out loss;
- `mean`: the workers adopt the mean of their parameters;
- `nesterov`: the outer step (DiLoCo / SNOO form, lr 0.7, momentum 0.9) on the pseudo-gradient
  outer - mean; the workers adopt the outer weights. The first round sets outer := mean.
Only parameters are merged and adopted: floating tensors of the state minus the carried-state
buffers (launcher.hub.merge.is_carried_state), which stay per worker. The arms share the first
segment (trained once, then copied), so round 1 is the same for all three.

Each round goes through the launcher's own code: every worker's weights are saved as a
checkpoint, then `launcher.hub.outer_step.outer_step` (the `mean` and `nesterov` arms, each
with its own pod folder and outer state) or `launcher.hub.merge.stream_mean` (the plain mean
of the `none` arm) reads them, and the workers adopt the round file's `params`.

    python benchmarks/bench_merge_rounds.py --seeds 0,1 --rounds 8 --steps 100 --json out.json

tests/test_bench_merge_rounds.py runs `run_seed` small and checks `mean` against
`nesterov` at lr 1, momentum 0.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from fractus.config import EngineConfig  # noqa: E402
from fractus.continuous_engine import ContinuousThoughtEngine  # noqa: E402
from fractus.data import batch_from_window, markov_chain, sample_chain  # noqa: E402
from fractus.train.env import WorkerSettings  # noqa: E402
from fractus.train.step import TrainStep  # noqa: E402
from launcher.hub.merge import is_carried_state, stream_mean  # noqa: E402
from launcher.hub.outer_step import OuterSettings, outer_step  # noqa: E402

# Smaller than the `tiny` preset (vocab 512, d 64, 2 blocks): one block, vocab 128, so 4
# workers x 3 arms x 2 seeds x several rounds fit in minutes on 2 shared cores.
ENGINE = EngineConfig(vocab_size=128, d_model=32, n_layers=1, n_heads=1, d_head=32, n_levels=2,
                      n_oscillators=4, coupling_rank=2, n_experts=4, top_k=2, expert_d_ff=32,
                      siren_rank=8)


@dataclass(frozen=True)
class Setup:
    workers: int = 4
    rounds: int = 8
    steps: int = 100            # optimizer steps per worker between two rounds
    batch: int = 4
    seq: int = 32
    lr: float = 0.05            # inner SGD (momentum 0.9, the worker's); 7e-4 barely moves here
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    heldout_rows: int = 16
    heldout_len: int = 128


# --- workers ----------------------------------------------------------------------------------

def merged_names(model) -> list[str]:
    return [k for k, t in model.state_dict().items()
            if t.is_floating_point() and not is_carried_state(k)]


class SimWorker:
    """One GPU's worker in-process: its model, optimizer, TrainStep, RNG and shard position."""

    def __init__(self, gpu: int, init: dict, shard: torch.Tensor, setup: Setup, seed: int):
        self.gpu, self.shard, self.setup, self.position, self.step = gpu, shard, setup, 0, 0
        self.model = ContinuousThoughtEngine.from_config(ENGINE)
        self.model.load_state_dict(init)
        self.model.set_gate_temperature(2.5)
        self.model.reset_thought(setup.batch)
        settings = WorkerSettings(gpu_id=gpu, batch=setup.batch, seq=setup.seq, lr=setup.lr,
                                  seed=seed)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=setup.lr, momentum=0.9)
        self.trainer = TrainStep(self.model, self.optimizer, settings, torch.device("cpu"))
        rng_seed = seed * 1000 + gpu
        self.py_rng = random.Random(rng_seed).getstate()
        self.torch_rng = torch.Generator().manual_seed(rng_seed).get_state()

    def train(self, steps: int) -> None:
        n = self.setup.batch * self.setup.seq
        random.setstate(self.py_rng)
        torch.set_rng_state(self.torch_rng)
        for _ in range(steps):
            window = self.shard[self.position:self.position + n + 1]
            self.trainer([batch_from_window(window, self.setup.batch, self.setup.seq)],
                         self.step)
            self.position += n
            self.step += 1
        self.py_rng, self.torch_rng = random.getstate(), torch.get_rng_state()

    def params(self) -> dict[str, torch.Tensor]:
        state = self.model.state_dict()
        return {k: state[k].detach().clone() for k in merged_names(self.model)}

    @torch.no_grad()
    def adopt(self, params: dict[str, torch.Tensor]) -> None:
        """Parameters replaced in place; optimizer state, RNG, position, carry stay."""
        state = self.model.state_dict()
        for k, t in params.items():
            state[k].copy_(t)


# --- corpus and held-out loss -----------------------------------------------------------------

def make_corpus(setup: Setup, seed: int) -> tuple[list[torch.Tensor], torch.Tensor, float]:
    """(one shard per worker, held-out (rows, len+1), the true chain's loss on the held-out):
    all walks of one chain of `seed`."""
    successors, cumweights = markov_chain(ENGINE.vocab_size, seed)
    need = setup.rounds * setup.steps * setup.batch * setup.seq + 1
    shards = [torch.from_numpy(sample_chain(successors, cumweights, need,
                                            np.random.default_rng([seed, i]), lanes=64))
              for i in range(setup.workers)]
    rows, span = setup.heldout_rows, setup.heldout_len + 1
    heldout = sample_chain(successors, cumweights, rows * span,
                           np.random.default_rng([seed, setup.workers]), lanes=rows)
    heldout = heldout.reshape(rows, span)
    probs = np.diff(cumweights, axis=1, prepend=0.0)
    cur, nxt = heldout[:, :-1].reshape(-1), heldout[:, 1:].reshape(-1)
    p_next = (probs[cur] * (successors[cur] == nxt[:, None])).sum(axis=1)
    return shards, torch.from_numpy(heldout).long(), float(-np.log(p_next).mean())


class Judge:
    """Teacher-forced CE of given parameters on the held-out rows, from a cold carried state."""

    def __init__(self, init: dict, heldout: torch.Tensor):
        self.model = ContinuousThoughtEngine.from_config(ENGINE)
        self.model.load_state_dict(init)
        self.model.set_gate_temperature(2.5)
        self.heldout = heldout

    @torch.no_grad()
    def loss(self, params: dict[str, torch.Tensor]) -> float:
        state = self.model.state_dict()
        for k, t in params.items():
            state[k].copy_(t)
        self.model.reset_thought(self.heldout.shape[0])
        logits = self.model.tick_chunk(self.heldout[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                               self.heldout[:, 1:].reshape(-1)).item()


# --- one seed ---------------------------------------------------------------------------------

def save_checkpoints(workers: list[SimWorker], folder: Path) -> list[Path]:
    """Each worker's weights as the checkpoint a GPU saves at a round's boundary."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for w in workers:
        paths.append(folder / f"gpu{w.gpu}.pt")
        torch.save({"model_state": w.model.state_dict(), "config": ENGINE.to_dict()}, paths[-1])
    return paths


def default_arms(setup: Setup) -> dict[str, OuterSettings]:
    return {"mean": OuterSettings("mean"),
            "nesterov": OuterSettings("nesterov", setup.outer_lr, setup.outer_momentum)}


def run_seed(setup: Setup, seed: int, outer_arms: dict[str, OuterSettings] | None = None) -> dict:
    """{arm: [held-out loss after round r]} for "none" and each of `outer_arms` (default:
    `mean`, and `nesterov` at the setup's lr and momentum), "none_each" (mean of the
    workers' own losses), "tokens_per_worker" [per round], "floor" (the true chain's loss on
    the held-out) and "final" {arm: the merged parameters after the last round}."""
    outer_arms = default_arms(setup) if outer_arms is None else outer_arms
    arms = ("none", *outer_arms)
    torch.manual_seed(seed)
    init = ContinuousThoughtEngine.from_config(ENGINE).state_dict()
    shards, heldout, floor = make_corpus(setup, seed)
    judge = Judge(init, heldout)
    first = [SimWorker(i, init, shards[i], setup, seed) for i in range(setup.workers)]
    for w in first:
        w.train(setup.steps)
    pods = {arm: copy.deepcopy(first) for arm in arms}
    out: dict = {arm: [] for arm in arms}
    out.update(none_each=[], tokens_per_worker=[], floor=floor)
    final: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench-merge-rounds-") as tmp:
        for r in range(setup.rounds):
            if r:
                for workers in pods.values():
                    for w in workers:
                        w.train(setup.steps)
            out["tokens_per_worker"].append((r + 1) * setup.steps * setup.batch * setup.seq)
            for arm, workers in pods.items():
                pod = Path(tmp) / arm
                paths = save_checkpoints(workers, pod / "checkpoints")
                if arm == "none":
                    mean = stream_mean(paths)   # tied names point at one mean, as in a round file
                    merged = {k: mean.means[mean.aliases.get(k, k)] for k, (_, dtype)
                              in mean.spec.items() if dtype.is_floating_point}
                    out["none_each"].append(statistics.fmean(
                        judge.loss(w.params()) for w in workers))
                else:
                    report = outer_step(pod, r + 1, paths, outer_arms[arm])
                    merged = torch.load(report.merged_path, weights_only=True)["params"]
                    for w in workers:
                        w.adopt(merged)
                out[arm].append(judge.loss(merged))
                final[arm] = merged
    out["final"] = final
    return out


# --- the table ----------------------------------------------------------------------------------

def table(results: dict) -> str:
    rounds = len(results["tokens_per_worker"])
    head = "| arm | " + " | ".join(f"r{r + 1}" for r in range(rounds)) + " |"
    lines = [head, "|" + "---|" * (rounds + 1),
             "| tokens per worker | " + " | ".join(
                 str(t) for t in results["tokens_per_worker"]) + " |"]
    rows = [("none: each worker (mean of 4)", results["none_each"]),
            ("none: mean of weights", results["none"])]
    rows += [(f"`{arm}` rounds", values) for arm, values in results.items()
             if arm not in ("none", "none_each", "tokens_per_worker", "floor", "final")]
    for name, values in rows:
        lines.append(f"| {name} | " + " | ".join(f"{v:.4f}" for v in values) + " |")
    lines.append(f"\nThe true chain's own loss on the held-out slice (the floor): "
                 f"{results['floor']:.4f}")
    return "\n".join(lines)


def average(per_seed: list[dict]) -> dict:
    keys = [k for k in per_seed[0] if k not in ("final", "tokens_per_worker", "floor")]
    avg = {k: [statistics.fmean(vals) for vals in zip(*(s[k] for s in per_seed))] for k in keys}
    avg["floor"] = statistics.fmean(s["floor"] for s in per_seed)
    avg["tokens_per_worker"] = per_seed[0]["tokens_per_worker"]
    return avg


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--rounds", type=int, default=Setup.rounds)
    p.add_argument("--steps", type=int, default=Setup.steps)
    p.add_argument("--lr", type=float, default=Setup.lr)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    setup = replace(Setup(), rounds=a.rounds, steps=a.steps, lr=a.lr)
    per_seed, started = [], time.monotonic()
    for seed in (int(s) for s in a.seeds.split(",")):
        t0 = time.monotonic()
        res = run_seed(setup, seed)
        res.pop("final")
        per_seed.append(res)
        print(f"\nseed {seed} ({time.monotonic() - t0:.0f} s, load {os.getloadavg()[0]:.1f})")
        print(table(res))
    if len(per_seed) > 1:
        print(f"\nmean of {len(per_seed)} seeds")
        print(table(average(per_seed)))
    print(f"\n{time.monotonic() - started:.0f} s in all; setup {asdict(setup)}")
    if a.json:
        a.json.write_text(json.dumps({"setup": asdict(setup), "seeds": per_seed}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
