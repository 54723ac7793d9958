"""Worker processes: environment, spawning, tailing the METRICS file, stopping. The launcher
never scrapes human log lines: it reads METRICS (JSON lines) from the offset it last reached.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Collection, Mapping

import psutil

from fractus.train.env import ENV_VARS
from launcher.paths import metrics_path, tensorboard_dir, worker_log_path
from launcher import child
from launcher.config.devices import Slot
from launcher.config.podconfig import PodConfig


@dataclass
class WorkerSpec:
    """Everything one worker start needs (the launcher decides, the worker obeys)."""
    slot: Slot
    stage_settings: dict
    start_token: int | None = None     # None: let the worker resume from its own file
    ckpt_in: str | None = None
    max_steps: int | None = None
    fault: str | None = None           # FRACTUS_FAULT, tests only
    stage: int | None = None           # STAGE: shown in TensorBoard only
    run_id: str | None = None          # RUN_ID: the manifest's run, recorded in checkpoints
    phase: int = 1                     # PHASE: the data phase whose shard it trains on
    # ckpt_in's bytes and the hub revision holding them (a remote node lacking it pulls it).
    ckpt_sha256: str | None = None
    ckpt_revision: str | None = None
    # Nothing the GPU wrote passed: token 0, its files set aside (here already; a remote
    # node sets its own aside before the worker starts).
    start_over: bool = False
    merge: dict | None = None          # MERGE_*: the pod's merge rounds, when on


def pod_env_names(config: PodConfig) -> set[str]:
    """The variable names the pod config gives its workers (child_env's `keep`)."""
    return set(config.env) | set(config.pass_env)


def build_env(config: PodConfig, spec: WorkerSpec, base: dict | None = None) -> dict:
    """Stage settings, then the pod's overrides, then identity, over `base` (worker_env)."""
    gpu = spec.slot.gpu
    env = dict(spec.stage_settings)
    env.update(config.env)
    env.update({
        "GPU_ID": str(gpu),
        "MODEL": config.model,
        "SHARD": config.shard_path(gpu, spec.phase),
        "PHASE": str(spec.phase),
        "CKPT_OUT": config.checkpoint_path(gpu),
        "METRICS": metrics_path(gpu),
        "SAVE_EVERY": str(config.save_every),
        "SAVE_KEEP": str(config.save_keep),
        "LOG_EVERY": str(config.log_every),
        "TB_DIR": tensorboard_dir(gpu),
        "PYTHONUNBUFFERED": "1",
    })
    if spec.slot.device == "cuda":
        env.update({"CUDA_VISIBLE_DEVICES": str(gpu), "DEVICE": "cuda"})
    else:
        # One thread per CPU worker: N workers share the cores instead of fighting for them.
        env.update({"CUDA_VISIBLE_DEVICES": "", "DEVICE": "cpu", "OMP_NUM_THREADS": "1",
                    "MKL_NUM_THREADS": "1"})
    if spec.start_token is not None:
        env["START_TOKEN"] = str(spec.start_token)
    if spec.ckpt_in:
        env["CKPT_IN"] = spec.ckpt_in
    if spec.max_steps:
        env["MAX_STEPS"] = str(spec.max_steps)
    if spec.fault:
        env["FRACTUS_FAULT"] = spec.fault
    if spec.stage is not None:
        env["STAGE"] = str(spec.stage)
    if spec.run_id:
        env["RUN_ID"] = spec.run_id
    env.update(spec.merge or {})
    return worker_env(os.environ if base is None else base, env, keep=pod_env_names(config))


def worker_env(base: Mapping[str, str], settings: Mapping[str, str],
               keep: Collection[str] = ()) -> dict:
    """`settings` over `base` (the worker's machine's environment, a Ray node's on that
    node) without any worker variable of `base` (a stray BATCH= or START_TOKEN= in a shell
    must not leak in), scrubbed like every child's (child.child_env: no secrets)."""
    names = set(ENV_VARS)
    return child.child_env({k: v for k, v in base.items() if k not in names}, keep=keep,
                           **settings)


def worker_command(config: PodConfig) -> list[str]:
    """The pod's `worker:` command; `python` is this interpreter in safe-path mode."""
    return child.resolve_command(config.worker)


def spawn_worker(config: PodConfig, pod_dir: Path, spec: WorkerSpec) -> subprocess.Popen:
    """One worker, SIGTERMed when the launcher dies (it checkpoints: no unsupervised writer)."""
    log = open(pod_dir / worker_log_path(spec.slot.gpu), "ab")
    try:
        return child.spawn(worker_command(config), cwd=pod_dir, env=build_env(config, spec),
                           keep=pod_env_names(config), stdout=log, stderr=subprocess.STDOUT, death_signal=signal.SIGTERM)
    finally:
        log.close()


class MetricsTail:
    """The one tail of a METRICS file: complete new lines only; a truncated file starts over."""

    def __init__(self, path: Path, from_end: bool = True, offset: int | None = None):
        """Start at `offset`, else at the file's end (`from_end`) or its beginning."""
        self.path = path
        if offset is None:
            offset = path.stat().st_size if (from_end and path.exists()) else 0
        self.offset = offset
        self._partial = b""

    @property
    def position(self) -> int:
        """Where the complete lines read so far end: another tail resumes here losslessly."""
        return self.offset - len(self._partial)

    def read_lines(self) -> list[bytes]:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return []
        if size < self.offset:           # truncated or replaced: start over
            self.offset, self._partial = 0, b""
        if size == self.offset:
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read(size - self.offset)
        self.offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()      # an unfinished last line waits for its newline
        return lines

    def read(self) -> list[dict]:
        """The new lines' JSON objects (an unreadable line is skipped)."""
        records = []
        for line in self.read_lines():
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
            if isinstance(record, dict):
                records.append(record)
        return records


def read_records(path: Path) -> list[dict]:
    return MetricsTail(path, from_end=False).read() if path.exists() else []


def terminate(procs: list[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM (the worker finishes its step and checkpoints), SIGKILL after grace_s."""
    for p in procs:
        if p.poll() is None:
            _signal(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal(p, signal.SIGKILL)
            p.wait()


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        _signal(proc, signal.SIGKILL)
        proc.wait()


def _signal(proc: subprocess.Popen, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except ProcessLookupError:
        pass


def _looks_like_worker(cmdline: list[str]) -> bool:
    text = " ".join(cmdline)
    return "fractus.train.worker" in text or "fast4gpu_boost" in text


def running_workers(pod_dir: Path) -> dict[int, int]:
    """GPU index -> pid of worker processes already running for this pod (any launcher)."""
    found: dict[int, int] = {}
    pod = str(pod_dir.resolve())
    for proc in psutil.process_iter(["pid", "cmdline", "cwd"]):
        try:
            if not _looks_like_worker(proc.info["cmdline"] or []):
                continue
            if proc.info["cwd"] != pod:
                continue
            gpu = proc.environ().get("GPU_ID")
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if gpu is not None and gpu.isdigit():
            found[int(gpu)] = proc.info["pid"]
    return found


def busy_cuda_gpus(indices: list[int]) -> dict[int, list[int]]:
    """GPU index -> pids of compute processes on it (any owner), from nvidia-smi."""
    if not indices or shutil.which("nvidia-smi") is None:
        return {}
    try:
        env = child.child_env()        # no secrets in any child's environment
        gpus = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"],
                              env=env, capture_output=True, text=True, timeout=20).stdout
        apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid",
                               "--format=csv,noheader"],
                              env=env, capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    by_uuid = {}
    for line in gpus.splitlines():
        index, _, uuid = (part.strip() for part in line.partition(","))
        if index.isdigit():
            by_uuid[uuid] = int(index)
    busy: dict[int, list[int]] = {}
    for line in apps.splitlines():
        pid, _, uuid = (part.strip() for part in line.partition(","))
        index = by_uuid.get(uuid)
        if index in indices and pid.isdigit():
            busy.setdefault(index, []).append(int(pid))
    return busy
