"""The stage canary: prove stage N continues stage M's curve before the pod switches.
Nothing here switches: the caller switches only when `result.passed`. Writes only under the
pod's `scratch/canary/` and CANARY_FILE; reads the pod's files only through the PodFiles
it is given. From one GPU's checkpoint, the real worker runs K steps with stage M's
settings, then K with stage N's (sequential by default: two 1B workers may not fit one
GPU), same checkpoint, token and SEED. Exact stages compare per step (SS_RATE=0: CE_CHUNK>0
draws SS tokens from another RNG stream); approximate ones run the trusted-loss checks.
Protocol and tolerances: docs/CANARY.md "What runs", "Exact stages".
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from fractus.train.exit_codes import WorkerExitCode
from launcher.files import read_json_state, write_json_state
from launcher.paths import CANARY_FILE, CANARY_SCRATCH_DIR
from launcher import child
from launcher.checks.canary_compare import compare_approximate, compare_exact, metrics_lines
from launcher.checks.pod_files import PodFiles
from launcher.errors import UserError
from launcher.checks.health import FAILED, INCONCLUSIVE, SUCCESSFUL
from launcher.pod.manifest import Manifest
from launcher.config.devices import Slot, parse_devices
from launcher.config.podconfig import PodConfig
from launcher.pod.progress import progress
from launcher.config.stages import Stage, get_stage
from launcher.worker.process import (WorkerSpec, build_env, pod_env_names, read_records,
                                     worker_command)

KEEP_RUNS = 5                    # canary run directories kept (metrics + logs, no weights)
WATCH_S = 0.5                    # how often a running canary shows progress, looks for a stop


def write_canary_state(pod_dir: Path, record: dict) -> None:
    """The last canary's verdict (a CanaryResult dict, or a skip), for `status`."""
    write_json_state(pod_dir / CANARY_FILE, {"ts": time.time(), **record})


def read_canary_state(pod_dir: Path) -> dict | None:
    return read_json_state(pod_dir / CANARY_FILE) or None


@dataclass
class CanaryResult:
    passed: bool
    status: str                  # Successful | Failed | Inconclusive (could not judge)
    exact: bool
    reason: str
    per_step: list = field(default_factory=list)   # canary_compare.StepComparison, per step
    seconds: float = 0.0
    from_stage: int = 0
    to_stage: int = 0
    gpu: int = 0
    device: str = "cpu"
    checkpoint: str | None = None
    start_token: int | None = None
    scratch: str | None = None
    interrupted: str | None = None   # why the canary was cut short (a stop, --max-time)
    out_of_memory: bool = False      # stage N's run did not fit (its worker's oom exit)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ResumePoint:
    checkpoint: str | None       # relative to the pod dir (or absolute); None: a fresh model
    start_token: int | None      # None: the full checkpoint's own next_token
    ema_tf: float | None
    phase: int = 1               # the data phase it trains on (its shard)


def resume_point(pod_dir: Path, config: PodConfig, manifest: Manifest, gpu: int) -> ResumePoint:
    """Where GPU `gpu` resumes: its manifest entry, else its canonical checkpoint file."""
    entry = manifest.entries.get(gpu)
    if entry and entry.checkpoint:
        return ResumePoint(entry.checkpoint, entry.start_token, entry.ema_tf, entry.at_phase)
    canonical = config.checkpoint_path(gpu)
    if (pod_dir / canonical).is_file():
        return ResumePoint(canonical, None, None)   # the worker reads train_state.next_token
    if entry and entry.start_token > 0:
        raise UserError(f"GPU {gpu} has progress (start_token {entry.start_token}) but "
                        f"no checkpoint to run the canary from")
    return ResumePoint(None, 0, None)


def _slot(config: PodConfig, gpu: int, device: str | None) -> Slot:
    if device is not None:
        if device not in ("cpu", "cuda"):
            raise UserError(f"canary device must be cpu or cuda, got {device!r}")
        return Slot(gpu, device)
    for slot in parse_devices(config.devices):
        if slot.gpu == gpu:
            return slot
    raise UserError(f"GPU {gpu} is not in the pod's devices {config.devices!r}")


def canary_env(config: PodConfig, slot: Slot, stage: Stage, start: ResumePoint, steps: int,
               run_dir: Path, exact: bool) -> dict:
    """The launcher's worker environment for this stage, redirected to scratch files."""
    spec = WorkerSpec(slot, stage.settings, start_token=start.start_token,
                      ckpt_in=start.checkpoint, max_steps=steps, phase=start.phase)
    env = build_env(config, spec)
    env.update({"CKPT_OUT": str(run_dir / "canary.pt"), "METRICS": str(run_dir / "metrics.jsonl"),
                "LOG_EVERY": "1", "SAVE_EVERY": "0", "SAVE_KEEP": "1",
                "SEED": config.env.get("SEED", str(42 + slot.gpu))})
    env.pop("FRACTUS_FAULT", None)
    env.pop("TB_DIR", None)      # a trial run: not part of the GPU's TensorBoard curves
    if exact:
        env["SS_RATE"] = "0"     # see the module docstring: the SS draw differs by design
    return env


@dataclass
class _Run:
    name: str
    run_dir: Path
    proc: subprocess.Popen | None = None
    code: int | None = None
    timed_out: bool = False
    interrupted: str | None = None

    def records(self) -> list[dict]:
        return read_records(self.run_dir / "metrics.jsonl")

    def failure(self) -> str | None:
        if self.interrupted:
            return f"{self.name} interrupted: {self.interrupted}"
        if self.timed_out:
            return f"{self.name} timed out (killed)"
        if self.code == WorkerExitCode.OK:
            return None
        events = [r for r in self.records() if r.get("event") in ("nan", "oom", "error")]
        if self.out_of_memory():
            oom = events[-1] if events and events[-1].get("event") == "oom" else {}
            where = f" at step {oom['step']}" if oom.get("step") else ""
            return (f"{self.name} ran out of memory{where} (exit {self.code}): "
                    f"{str(oom.get('message', 'no oom event'))[:300]}")
        if events:
            detail = events[-1].get("message", events[-1].get("event"))
        else:
            lines = [s for s in (self.run_dir / "worker.log").read_text(errors="replace")
                     .splitlines() if s.strip()] if (self.run_dir / "worker.log").exists() else []
            detail = lines[-1] if lines else "no output"
        return f"{self.name} worker exited {self.code}: {str(detail)[:300]}"


    def out_of_memory(self) -> bool:
        """The worker's out-of-memory exit (4; an `oom` event when its metrics file was open)."""
        return self.code == WorkerExitCode.OOM and not self.interrupted and not self.timed_out


def _start(run: _Run, command: list[str], env: dict, cwd: Path, keep: set[str]) -> None:
    run.run_dir.mkdir(parents=True, exist_ok=True)
    with open(run.run_dir / "worker.log", "wb") as log:
        try:
            run.proc = child.spawn(command, cwd=cwd, env=env, keep=keep,  # own group: killpg
                                   stdout=log, stderr=subprocess.STDOUT)
        except OSError as exc:
            raise UserError(f"canary: cannot start the worker command {command}: {exc}") from None


def _kill(run: _Run) -> None:
    """SIGKILL the worker's process group (torch.compile may have spawned helpers)."""
    child.kill_group(run.proc)
    run.proc.wait()


def _wait(run: _Run, deadline: float, watch=None,
          should_stop: Callable[[], str | None] = lambda: None) -> None:
    """Until exit, deadline or a stop (killed at once: it writes only scratch); `watch()`s."""
    while True:
        left = deadline - time.monotonic()
        try:
            run.code = run.proc.wait(timeout=max(0.0, min(WATCH_S, left)))
            return
        except subprocess.TimeoutExpired:
            pass
        stop = should_stop()
        if stop or left <= WATCH_S:
            break
        if watch is not None:
            watch()
    _kill(run)
    run.code = run.proc.returncode
    run.interrupted, run.timed_out = stop, not stop


def _execute(runs: list[_Run], envs: list[dict], command: list[str], keep: set[str], cwd: Path,
             parallel: bool, deadline: float, watch=None,
             should_stop: Callable[[], str | None] = lambda: None) -> None:
    """Run the reference (runs[0]) and stage-N workers; none is left behind on any exit."""
    try:
        for run, env in zip(runs, envs):
            if not parallel and run is runs[1] and runs[0].failure():
                break                      # nothing to compare stage N with
            _start(run, command, env, cwd, keep)
            if not parallel:
                _wait(run, deadline, watch, should_stop)
        for run in runs:
            if run.proc is not None and run.code is None:
                _wait(run, deadline, watch, should_stop)
    finally:
        for run in runs:
            if run.proc is not None and run.proc.poll() is None:
                _kill(run)


def _show_steps(task, title: str, runs: list[_Run], steps: int) -> None:
    """Which stage's run is at which step (before step 1 it loads the model)."""
    done = {run.name: min(len(metrics_lines(run.records())), steps)
            for run in runs if run.proc is not None}
    running = [run.name for run in runs if run.proc is not None and run.code is None]
    where = ", ".join(f"{name} step {done[name]}/{steps}" if done[name] else
                      f"{name} loading the model" for name in running)
    task.update(completed=sum(done.values()), description=f"{title}: {where or 'comparing'}")


def _clean(scratch_root: Path, run_dir: Path) -> None:
    """Drop the scratch weights (GBs); keep the newest KEEP_RUNS runs' metrics and logs."""
    for path in run_dir.rglob("*.pt*"):
        path.unlink(missing_ok=True)
    runs = sorted((p for p in scratch_root.iterdir() if p.is_dir()), key=lambda p: p.name)
    for old in runs[:-KEEP_RUNS]:
        shutil.rmtree(old, ignore_errors=True)


def run_canary(plan: PodFiles, manifest: Manifest, gpu: int, from_stage: int,
               to_stage: int, steps: int | None = None, device: str | None = None,
               timeout_s: float | None = None, parallel: bool = False,
               should_stop: Callable[[], str | None] = lambda: None) -> CanaryResult:
    """The canary for switching GPU `gpu` from stage M to N > M (UserError before anything
    runs otherwise). `device` defaults to the pod's for that GPU, `steps`/`timeout_s` to the
    criteria's canary section. A reason from `should_stop` cuts it short (Inconclusive)."""
    t0 = time.monotonic()
    pod_dir, config, stages = Path(plan.pod_dir).resolve(), plan.config, plan.stages
    ref_stage, new_stage = get_stage(stages, from_stage), get_stage(stages, to_stage)
    if to_stage <= from_stage:
        raise UserError(f"the canary checks a switch up: to_stage {to_stage} must be > "
                        f"from_stage {from_stage}")
    settings, criteria = plan.trusted.canary, plan.trusted.criteria
    steps = settings.steps if steps is None else steps
    if steps < 2:
        raise UserError(f"canary steps must be >= 2 (step 1 only checks the forward), got {steps}")
    timeout_s = settings.timeout_s if timeout_s is None else timeout_s
    slot = _slot(config, gpu, device)
    start = resume_point(pod_dir, config, manifest, gpu)
    exact = all(stages[n].exact for n in range(from_stage + 1, to_stage + 1))

    scratch_root = pod_dir / CANARY_SCRATCH_DIR
    scratch_root.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(dir=scratch_root, prefix=f"{time.strftime('%Y%m%d-%H%M%S')}"
                                    f"-gpu{gpu}-s{from_stage}to{to_stage}-"))
    result = CanaryResult(False, INCONCLUSIVE, exact, "", from_stage=from_stage,
                          to_stage=to_stage, gpu=gpu, device=slot.device,
                          checkpoint=start.checkpoint, start_token=start.start_token,
                          scratch=str(run_dir.relative_to(pod_dir)))
    runs = [_Run(f"stage {s.number}", run_dir / f"stage{s.number}") for s in (ref_stage, new_stage)]
    envs = [canary_env(config, slot, stage, start, steps, run.run_dir, exact)
            for run, stage in zip(runs, (ref_stage, new_stage))]
    title = f"canary stage {from_stage} -> {to_stage} on GPU {gpu}"
    with progress(title, 2 * steps, "steps") as task:
        _execute(runs, envs, worker_command(config), pod_env_names(config), pod_dir, parallel,
                 time.monotonic() + timeout_s, watch=lambda: _show_steps(task, title, runs, steps),
                 should_stop=should_stop)
        _show_steps(task, title, runs, steps)
    result.interrupted = runs[0].interrupted or runs[1].interrupted
    ref_fail, new_fail = runs[0].failure(), runs[1].failure()
    started = [r for r in runs[0].records() if r.get("event") == "start"]
    if started and result.start_token is None:
        result.start_token = started[0].get("next_token")
    logged = len(metrics_lines(runs[0].records()))
    if not ref_fail and logged < steps:
        ref_fail = f"it logged {logged} of {steps} steps (end of the shard?)"
    if result.interrupted:
        result.reason = f"interrupted ({result.interrupted}): stage {to_stage} not judged"
    elif ref_fail:
        result.reason = f"cannot judge stage {to_stage}: the reference run failed: {ref_fail}"
    elif new_fail:
        result.status, result.reason = FAILED, new_fail
        result.out_of_memory = runs[1].out_of_memory()
    else:
        names = (runs[0].name, runs[1].name)
        if exact:
            tol = settings.exact["cuda" if slot.device == "cuda" else "cpu"]
            ok, reason, rows = compare_exact(runs[0].records(), runs[1].records(), tol, steps,
                                             names)
        else:
            ok, reason, rows = compare_approximate(runs[0].records(), runs[1].records(), criteria,
                                                   steps, settings.max_ema_tf_rise,
                                                   start.ema_tf, names)
        result.passed, result.status = ok, SUCCESSFUL if ok else FAILED
        result.reason, result.per_step = reason, rows
    _clean(scratch_root, run_dir)
    result.seconds = time.monotonic() - t0
    return result
