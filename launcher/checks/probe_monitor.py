"""The AR probe as one of the supervisor's health checks: neither the workers nor the poll
loop ever wait for a probe, and a failed probe's checkpoint is never restored. Owns
checkpoints/probe/: a queued checkpoint is hard-linked there (rotation and pruning may
delete every other name for it first), each hold under a name of its own, so a probe that
ends after a rollback removes its own link, never the new stage's. At most one probe per
GPU in flight, `probe.parallel` across the pod (a CPU probe holds its weights in host
memory). The baseline (first found: recorded, the resume checkpoint's probe, the first
probe) holds for one shard, so one data phase. Behaviour: docs/LAUNCHER.md "Health checks"
(the AR probe paragraph). On Ray the node holding the file runs its probe; a lost node's
probes are abandoned, no verdict.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from launcher.paths import PROBE_DIR
from launcher.checks.health import FAILED, INCONCLUSIVE
from launcher.checks.probe_outcome import (BASELINE, ProbeOutcome, ProbeRequest,
                                           recorded_baseline)
from launcher.checks.probe_check import (
    Baseline,
    ProbeSchedule,
    ProbeLost,
    ProbeTolerance,
    ProbeUnavailable,
    probe_verdict,
    run_probe_process,
)

LOST = object()                # a probe's error when its node was lost (ProbeLost)
PROBE_MODULE = "fractus.eval.probe"


@dataclass
class _GpuProbes:
    waiting: deque = field(default_factory=deque)
    in_flight: ProbeRequest | None = None
    baselines: dict = field(default_factory=dict)   # shard -> (Baseline, where it came from)
    seen: int = 0              # new checkpoints since the stage started
    vouched_step: int | None = None   # newest checkpoint step a probe did not fail
    waiting_since: int = 0     # when its queue last became non-empty (fair turns)


class ProbeMonitor:
    def __init__(self, pod_dir: Path, schedule: ProbeSchedule, tolerance: ProbeTolerance,
                 runner=run_probe_process, model: str | None = None):
        self.pod_dir, self.schedule, self.tolerance = pod_dir, schedule, tolerance
        self.runner = runner
        self.model = model          # the pod's model: the config of a bare state_dict
        self.gpus: dict[int, _GpuProbes] = {}
        self.generation = 0
        self._ticket = 0
        self._holds = 0             # names each hard link of ours apart
        self._done: queue.Queue = queue.Queue()
        self.nodes = None           # where probes run on a remote backend (use_nodes)
        self._lost: list[ProbeRequest] = []     # ended with their node, not yet abandoned

    @classmethod
    def from_trusted_loss(cls, pod_dir: Path, trusted, model: str | None = None
                          ) -> "ProbeMonitor | None":
        """From the parsed criteria file; None when it turns probing off."""
        if trusted.probe_schedule.every <= 0:
            return None
        return cls(pod_dir, trusted.probe_schedule, trusted.probe_tolerance, model=model)

    def use_nodes(self, nodes) -> None:
        """Probe on a remote backend's nodes: `nodes.hold(gpu, checkpoint, sha256)` -> its
        node's name for it (None: gone); `nodes.run(request, **options)` blocks -> the
        result dict, or raises ProbeUnavailable."""
        self.nodes = nodes

    def start_stage(self, stage: int, resume: dict[int, tuple[str | None, str]],
                    heads: dict[int, int] | None = None) -> None:
        """A stage (re)starts: `resume` maps each GPU to (checkpoint resumed from or None,
        shard), `heads` to the token it resumed at. Running probes are ignored from now."""
        self.generation += 1
        self._lost = []
        for probes in self.gpus.values():
            for request in probes.waiting:
                self._unlink(request)
        self.gpus = {}
        for gpu, (checkpoint, shard) in resume.items():
            probes = _GpuProbes()
            baseline = recorded_baseline(self.pod_dir, stage, gpu)
            if baseline is not None:      # recorded for the shard the GPU resumes on
                probes.baselines[shard] = (baseline, f"recorded for stage {stage}")
            elif checkpoint is not None:
                # Held at once: the worker rewrites the file it resumed from at its first save.
                held = self._hold(gpu, checkpoint, "resume")
                if held is not None:
                    self._enqueue(probes, ProbeRequest(gpu, held, shard, BASELINE,
                                                       head=(heads or {}).get(gpu)))
            self.gpus[gpu] = probes

    def start_phase(self, gpu: int, checkpoint: str, shard: str) -> None:
        """`checkpoint` (the phase before's end) probed on `shard` from token 0 is the new
        phase's baseline (held at once: the worker rewrites the file at its first save)."""
        probes = self.gpus.setdefault(gpu, _GpuProbes())
        if shard in probes.baselines:
            return
        held = self._hold(gpu, checkpoint, "phase")
        if held is not None:
            self._enqueue(probes, ProbeRequest(gpu, held, shard, BASELINE, head=0))

    def on_checkpoint(self, gpu: int, checkpoint: str, shard: str, sha256: str | None,
                      step: int | None) -> bool:
        """A new checkpoint of `gpu`; True when it will be probed."""
        probes = self.gpus.setdefault(gpu, _GpuProbes())
        probes.seen += 1
        if probes.seen % self.schedule.every:
            return False
        # A newer checkpoint replaces one waiting, keeping the GPU's place in line: at the
        # back, a GPU saving faster than a probe takes would never be probed.
        place = probes.waiting_since if probes.waiting else None
        for stale in [r for r in probes.waiting if r.role != BASELINE]:
            probes.waiting.remove(stale)
            self._unlink(stale)
        held = self._hold(gpu, checkpoint, sha256)
        if held is None:
            return False        # the file is gone already: nothing to probe
        self._enqueue(probes, ProbeRequest(gpu, held, shard, "check", sha256, step))
        if place is not None:
            probes.waiting_since = place
        return True

    def probe_final(self, gpu: int, checkpoint: str, shard: str, sha256: str | None,
                    step: int | None) -> bool:
        """Clean end: probe the last checkpoint so it can pass and go up; True: a probe is due."""
        probes = self.gpus.get(gpu)
        if probes is None or step is None or (probes.vouched_step or -1) >= step:
            return False
        if any(r.sha256 == sha256 for r in [probes.in_flight, *probes.waiting] if r):
            return True         # already queued or running
        held = self._hold(gpu, checkpoint, sha256)
        if held is None:
            return False
        self._enqueue(probes, ProbeRequest(gpu, held, shard, "check", sha256, step))
        return True

    def probing(self, gpus) -> int:
        return sum(1 for gpu in gpus if (p := self.gpus.get(gpu)) and (p.in_flight or p.waiting))

    def widen_for_finish(self, probes_due: int, checkpoint_bytes: int) -> int:
        """Workers stopped: run the due probes at once, bounded by free memory (a CPU probe
        holds ~2.5x its checkpoint: file + model), sharing the cores. Returns how many."""
        by_memory = int(psutil.virtual_memory().available // max(1, int(2.5 * checkpoint_bytes)))
        parallel = max(1, min(probes_due, by_memory))
        threads = max(1, (os.cpu_count() or 1) // parallel)
        self.schedule = dataclasses.replace(self.schedule, parallel=parallel)
        if threads > 1:
            self.runner = functools.partial(self.runner, threads=threads)
        return parallel

    def _enqueue(self, probes: _GpuProbes, request: ProbeRequest) -> None:
        if not probes.waiting:
            self._ticket += 1
            probes.waiting_since = self._ticket
        probes.waiting.append(request)

    def _hold(self, gpu: int, checkpoint: str, sha256: str | None) -> str | None:
        """Our own hard link (else the path itself; on nodes, their name); None: file gone."""
        if self.nodes is not None:
            return self.nodes.hold(gpu, checkpoint, sha256)
        source = self.pod_dir / checkpoint
        self._holds += 1
        name = f"{PROBE_DIR}/gpu{gpu}-{(sha256 or 'x')[:16]}-{self._holds}.pt"
        target = self.pod_dir / name
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp")
        tmp.unlink(missing_ok=True)
        try:
            os.link(source, tmp)
        except FileNotFoundError:
            return None
        except OSError:
            return checkpoint
        os.replace(tmp, target)
        return name

    def _unlink(self, request: ProbeRequest) -> None:
        if self.nodes is None and request.checkpoint.startswith(PROBE_DIR + "/"):
            (self.pod_dir / request.checkpoint).unlink(missing_ok=True)

    def poll(self) -> list[ProbeOutcome]:
        """Judge the probes that finished since the last poll, then start waiting ones."""
        outcomes = []
        while True:
            try:
                generation, request, result, error, seconds = self._done.get_nowait()
            except queue.Empty:
                break
            if generation != self.generation or request.gpu not in self.gpus \
                    or self.gpus[request.gpu].in_flight is not request:
                self._unlink(request)
                continue            # a probe of a stage the pod has left, or abandoned
            probes = self.gpus[request.gpu]
            probes.in_flight = None
            self._unlink(request)
            if error is LOST:           # its node is gone: no verdict (see abandon)
                self._lost.append(request)
                continue
            outcome = self._judge(probes, request, result, error, seconds)
            if request.role != BASELINE and outcome.status != FAILED and request.step is not None:
                probes.vouched_step = max(probes.vouched_step or 0, request.step)
            outcomes.append(outcome)
        running = sum(p.in_flight is not None for p in self.gpus.values())
        ready = sorted((p for p in self.gpus.values() if p.in_flight is None and p.waiting),
                       key=lambda p: p.waiting_since)      # the longest-waiting GPU first
        for probes in ready[:max(0, self.schedule.parallel - running)]:
            self._start(probes, probes.waiting.popleft())
            if probes.waiting:
                self._ticket += 1
                probes.waiting_since = self._ticket
        return outcomes

    def vouched_step(self, gpu: int) -> int | None:
        """Checkpoints up to this step may pass (else rollback could restore one a running
        probe then fails)."""
        probes = self.gpus.get(gpu)
        return probes.vouched_step if probes else None

    def abandon(self, gpu: int) -> list[ProbeRequest]:
        """`gpu`'s node is gone: drop its probes without a verdict; returns them."""
        dropped = [r for r in self._lost if r.gpu == gpu]
        self._lost = [r for r in self._lost if r.gpu != gpu]
        probes = self.gpus.get(gpu)
        if probes is None:
            return dropped
        dropped += [r for r in (probes.in_flight, *probes.waiting) if r is not None]
        for request in probes.waiting:
            self._unlink(request)
        probes.waiting.clear()
        probes.in_flight = None
        return dropped

    def busy(self) -> bool:
        return any(p.in_flight is not None or p.waiting for p in self.gpus.values())

    def close(self) -> None:
        """Stop: ignore running probes and end their processes (our own children only)."""
        self.generation += 1
        self.gpus = {}
        for child in psutil.Process().children(recursive=False):
            try:
                if PROBE_MODULE in " ".join(child.cmdline()):
                    child.kill()
            except psutil.Error:
                pass
        for link in (self.pod_dir / PROBE_DIR).glob("gpu*.pt"):
            link.unlink(missing_ok=True)

    def _start(self, probes: _GpuProbes, request: ProbeRequest) -> None:
        probes.in_flight = request
        generation = self.generation

        def work():
            began = time.monotonic()
            result = error = None
            options = dict(timeout_s=self.schedule.timeout_s, head=request.head,
                           rows=self.schedule.rows, model=self.model)
            try:
                if self.nodes is not None:      # on the node that holds the checkpoint
                    result = self.nodes.run(request, **options)
                else:
                    result = self.runner(request.checkpoint, request.shard, cwd=self.pod_dir,
                                         **options)
            except ProbeLost:
                error = LOST
            except ProbeUnavailable as exc:
                error = str(exc)
            except Exception as exc:          # never let a probe take the launcher down
                error = f"{type(exc).__name__}: {exc}"
            self._done.put((generation, request, result, error, time.monotonic() - began))

        threading.Thread(target=work, name=f"probe-gpu{request.gpu}", daemon=True).start()

    def _judge(self, probes: _GpuProbes, request: ProbeRequest, result, error,
               seconds: float) -> ProbeOutcome:
        ar = result.get("ar") if result else None
        usable = error is None and isinstance(ar, (int, float)) and math.isfinite(ar)
        known = probes.baselines.get(request.shard)     # the same data's baseline, or None
        if request.role == BASELINE or (usable and known is None):
            if usable:
                source = ("resume checkpoint" if request.role == BASELINE else
                          "first probe of the stage" if not probes.baselines else
                          f"first probe on {request.shard}")
                baseline = Baseline.of(result)
                probes.baselines[request.shard] = (baseline, source)
                spread = baseline.spread()
                noise = "" if spread is None else f", window spread {spread:.4f}"
                return ProbeOutcome(request, BASELINE, f"baseline AR {ar:.4f} "
                                    f"({source}{noise})", result, seconds, baseline)
            # The resume checkpoint gave no AR: the first check probe on its shard sets one.
            _, reason = probe_verdict(result, None, self.tolerance, error=error)
            return ProbeOutcome(request, INCONCLUSIVE, f"baseline: {reason}", result, seconds)
        baseline = known[0] if known else None
        status, reason = probe_verdict(result, baseline, self.tolerance, error=error)
        return ProbeOutcome(request, status, reason, result, seconds, baseline)
