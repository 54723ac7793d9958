"""The training step: the reference v1 step (ACCUM=1), or ACCUM batches per optimizer step.

ACCUM=1 with CE_CHUNK=0 is v1's step bit for bit (tests/test_worker_reference.py): a TF
pass with its own SGD step, then with probability SS_RATE an SS pass with its own. The
passes and the opt-in deviations (ACCUM>1, CE_CHUNK>0): docs/WORKER.md, "The training
step". The SS coin is drawn before the TF pass (every draw still equals v1's) so the TF
pass knows whether to keep state for sampling.
"""

from __future__ import annotations

import contextlib
import math
import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fractus.train.env import WorkerSettings
from fractus.train.faults import FaultInjector

SS_TEMPERATURE = 0.9   # v1's sampling temperature
SS_LOSS_WEIGHT = 0.5   # v1 halves the CE of the SS pass
CLIP_NORM = 1.0


class NonFiniteError(RuntimeError):
    """Loss or gradient norm not finite: the worker stops without checkpointing (exit 3)."""

    def __init__(self, step: int, values: dict):
        self.step = step
        self.values = values
        super().__init__(f"non-finite loss or gradient at step {step}: {values}")


def read_finite(step: int, watched: dict, grad_norm: torch.Tensor) -> dict:
    """Watched scalars + "grad_norm" (last), one host sync; NonFiniteError unless all finite."""
    tensors = [t.detach().float().reshape(()) for t in watched.values()]
    numbers = torch.stack(tensors + [grad_norm.detach().float().reshape(())]).tolist()
    values = dict(zip([*watched, "grad_norm"], numbers))
    if not all(math.isfinite(v) for v in values.values()):
        raise NonFiniteError(step, values)
    return values


class InjectedCompileError(RuntimeError):
    """Stands in for a torch.compile failure (FRACTUS_FAULT=compile@S)."""


# First compiled step vs the eager step from the same state and tokens:
# |compiled - eager| <= atol + rtol*|eager|. The eager step's own noise floor at step 1
# (weights perturbed 1e-7 relative; tiny and small, chunked CE; docs/WORKER.md): tf 9e-5,
# lb 2.1e-2 (Kuramoto is chaotic at fresh weights), grad_norm 4.9e-4; bf16 vs float32
# 1e-3. Each rtol is >= 5x the larger, so only a step computing something else falls out.
COMPILE_BAND = {"tf": (1e-2, 0.0), "lb": (1e-1, 1e-6), "grad_norm": (1e-1, 0.0)}


def compiled_divergence(compiled: StepResult | NonFiniteError, eager: StepResult) -> str | None:
    """Why the first compiled step differs from eager beyond COMPILE_BAND, or None."""
    if isinstance(compiled, NonFiniteError):
        return f"not finite where the eager step is: {compiled.values}"
    for key, (rtol, atol) in COMPILE_BAND.items():
        new, ref = getattr(compiled, key), getattr(eager, key)
        if not abs(new - ref) <= atol + rtol * abs(ref):
            return f"{key} {new:.6g} against eager {ref:.6g} (band: rtol {rtol:g}, atol {atol:g})"
    return None


@dataclass(frozen=True)
class StepResult:
    tf: float                 # teacher-forced CE (mean over the ACCUM batches)
    lb: float                 # load-balance term of the TF pass(es)
    grad_norm: float          # total gradient norm before clipping (TF pass when ACCUM=1)
    ss: float | None          # SS-pass CE, None when no SS pass ran in this step


class TrainStep:
    """Runs one optimizer step (two with SS at ACCUM=1) on the given batches."""

    def __init__(self, model, optimizer: torch.optim.Optimizer, settings: WorkerSettings,
                 device: torch.device, faults: FaultInjector | None = None):
        self.model = model
        self.optimizer = optimizer
        self.s = settings
        self.device = device
        self.faults = faults or FaultInjector(None)
        self.params = [p for p in model.parameters()]
        self.optimizer_steps = 0  # lets the compile fallback know whether weights moved
        self.compiled = False
        self.uncompile()

    # --- compile ----------------------------------------------------------------------
    def compile(self, backend: str = "inductor") -> None:
        """Compile the chunk functions (`backend="eager"`: dynamo's trace alone, for tests)."""
        self._fit_carried_phases()
        self.tick = torch.compile(self.model.tick_chunk_train, backend=backend, dynamic=False)
        self.tick_ce = torch.compile(self.model.tick_chunk_train_ce, backend=backend,
                                     dynamic=False)
        self.compiled = True

    def _fit_carried_phases(self) -> None:
        """Carried Kuramoto phases as (B, SEQ, N) zeros unless already so: never read, but
        the compiled step guards their shape (a reset's (B, 1, N) recompiles at step 2)."""
        for blk in self.model.blocks:
            phases = blk.kuramoto_phases
            if phases.shape[1] != self.s.seq:
                blk.kuramoto_phases = phases.new_zeros(phases.shape[0], self.s.seq,
                                                       phases.shape[2])

    def compile_counts(self) -> dict:
        """dynamo's process-wide counts: `graphs` (unique_graphs), `graph_breaks`,
        `recompiles` (cache entries beyond the first per chunk function). Once: 1, 0, 0."""
        # dynamo's private counters (pinned to the tested torch), only when a compile is counted
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
        from torch._dynamo.utils import counters
        codes = (self.model.tick_chunk_train.__func__.__code__,
                 self.model.tick_chunk_train_ce.__func__.__code__)
        entries = [len(_debug_get_cache_entry_list(code)) for code in codes]
        return {"graphs": int(counters["stats"]["unique_graphs"]),
                "graph_breaks": int(sum(counters["graph_break"].values())),
                "recompiles": sum(max(n - 1, 0) for n in entries)}

    def uncompile(self) -> None:
        self.tick = self.model.tick_chunk_train
        self.tick_ce = self.model.tick_chunk_train_ce
        self.compiled = False

    @contextlib.contextmanager
    def eager(self):
        """The uncompiled step for a while, the compiled functions kept for after."""
        kept = self.tick, self.tick_ce, self.compiled
        self.uncompile()
        try:
            yield
        finally:
            self.tick, self.tick_ce, self.compiled = kept

    def snapshot(self) -> dict:
        """Weights and optimizer state on the host (with carry and RNG: a step's inputs)."""
        def host(value):
            return value.detach().to("cpu", copy=True) if torch.is_tensor(value) else value
        state = self.optimizer.state_dict()
        return {"params": [host(p) for p in self.params],
                "optimizer": {"state": {k: {n: host(v) for n, v in per.items()}
                                        for k, per in state["state"].items()},
                              "param_groups": state["param_groups"]}}

    @torch.no_grad()
    def restore(self, snapshot: dict) -> None:
        for p, saved in zip(self.params, snapshot["params"]):
            p.copy_(saved)
        self.optimizer.load_state_dict(snapshot["optimizer"])
        self.optimizer.zero_grad(set_to_none=True)

    @property
    def bf16(self) -> bool:
        """BF16, else the device's default: bf16 autocast on CUDA (v1's), float32 on CPU."""
        return self.device.type == "cuda" if self.s.bf16 is None else self.s.bf16

    def _autocast(self):
        if self.bf16:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # --- passes -----------------------------------------------------------------------
    def _forward(self, obs, target, want_sampling: bool, step: int):
        """(ce, lb, sampler state): sampler state is the logits (dense) or the hidden state."""
        if self.compiled and self.faults.compile_fails(step):
            raise InjectedCompileError(f"injected compile failure at step {step}")
        with self._autocast():
            if self.s.ce_chunk == 0:
                logits, lb = self.tick(obs)
                ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))
                state = logits if want_sampling else None   # held only for sampling
            else:
                # Always return_hidden: one signature, one compiled graph (a second
                # variant would recompile at the first SS pass).
                ce, lb, hidden = self.tick_ce(obs, target, self.s.ce_chunk, return_hidden=True)
                state = hidden if want_sampling else None
        if self.compiled:
            ce = self.faults.compiled_ce(step, ce)
        return ce, lb, state

    @torch.no_grad()
    def _mixed_chunk(self, chunk: torch.Tensor, sampler_state: torch.Tensor) -> torch.Tensor:
        """v1's scheduled-sampling input: the multinomial draw, then the replacement mask."""
        try:
            sampled = self._sample(sampler_state)
        except (FloatingPointError, RuntimeError):
            # multinomial / the chunked sampler refuse non-finite weights: report it as such
            if not torch.isfinite(sampler_state).all():
                raise NonFiniteError(self._step, {"ss_sampling": float("nan")}) from None
            raise
        b, seq = chunk.shape
        use_ss = torch.rand(b, seq, device=chunk.device) < self.s.ss_prob
        use_ss[:, 0] = False
        prev = torch.cat([chunk[:, :1], sampled[:, :-1].to(chunk.dtype)], dim=1)
        return torch.where(use_ss, prev, chunk)

    def _sample(self, sampler_state: torch.Tensor) -> torch.Tensor:
        """One token per position: the dense multinomial (v1), or the chunked sampler."""
        b, seq = sampler_state.shape[:2]
        if self.s.ce_chunk == 0:
            logits = sampler_state.detach().float()
            probs = torch.softmax(logits.reshape(-1, logits.size(-1)) / SS_TEMPERATURE, dim=-1)
            sampled = torch.multinomial(probs, 1).view(b, seq)
        else:
            from fractus.nn.ce import sample_tokens_chunked  # only when SS samples chunked
            sampled = sample_tokens_chunked(sampler_state.detach(), self.model.observe.weight,
                                            SS_TEMPERATURE, self.s.ce_chunk)
        return sampled

    def _scaled(self, loss: torch.Tensor, step: int) -> torch.Tensor:
        scale = self.faults.loss_scale(step)
        return loss if scale is None else loss * scale

    def _clip_check_step(self, step: int, watched: dict) -> float:
        """Clip, refuse non-finite values before the weights move, then SGD step."""
        norm = torch.nn.utils.clip_grad_norm_(self.params, CLIP_NORM)
        values = read_finite(step, watched, norm)
        self.optimizer.step()
        self.optimizer_steps += 1
        return values["grad_norm"]

    # --- the step ---------------------------------------------------------------------
    def __call__(self, batches: list[tuple[torch.Tensor, torch.Tensor]], step: int) -> StepResult:
        self._step = step
        if len(batches) == 1:
            return self._reference_step(*batches[0], step)
        return self._accumulated_step(batches, step)

    def _reference_step(self, chunk, target, step: int) -> StepResult:
        do_ss = random.random() < self.s.ss_rate
        ce, lb, sampler_state = self._forward(chunk, target, do_ss, step)
        loss = self._scaled(ce + self.s.lb_coef * lb, step)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = self._clip_check_step(step, {"loss": loss, "tf": ce, "lb": lb})
        tf, lb_v = float(ce.detach()), float(lb.detach())
        ss = None
        if do_ss:
            mixed = self._mixed_chunk(chunk, sampler_state)
            del sampler_state  # free the TF logits before the SS forward
            ce2, lb2, _ = self._forward(mixed, target, False, step)
            loss2 = self._scaled(SS_LOSS_WEIGHT * ce2 + self.s.lb_coef * lb2, step)
            self.optimizer.zero_grad(set_to_none=True)
            loss2.backward()
            self._clip_check_step(step, {"ss_loss": loss2})
            ss = float(ce2.detach())
        return StepResult(tf=tf, lb=lb_v, grad_norm=grad_norm, ss=ss)

    def _accumulated_step(self, batches, step: int) -> StepResult:
        n = len(batches)
        self.optimizer.zero_grad(set_to_none=True)
        tfs, lbs, sss, watched = [], [], [], {}
        for i, (chunk, target) in enumerate(batches):
            do_ss = random.random() < self.s.ss_rate
            ce, lb, sampler_state = self._forward(chunk, target, do_ss, step)
            loss = self._scaled(ce + self.s.lb_coef * lb, step)
            (loss / n).backward()
            tfs.append(ce.detach())
            lbs.append(lb.detach())
            watched[f"loss{i}"] = loss
            if do_ss:
                mixed = self._mixed_chunk(chunk, sampler_state)
                del sampler_state
                ce2, lb2, _ = self._forward(mixed, target, False, step)
                loss2 = self._scaled(SS_LOSS_WEIGHT * ce2 + self.s.lb_coef * lb2, step)
                (loss2 / n).backward()
                sss.append(ce2.detach())
                watched[f"ss_loss{i}"] = loss2
        grad_norm = self._clip_check_step(step, watched)
        ss = float(torch.stack(sss).mean()) if sss else None
        return StepResult(tf=float(torch.stack(tfs).mean()), lb=float(torch.stack(lbs).mean()),
                          grad_norm=grad_norm, ss=ss)
