"""The part of the Ray backend that runs ON a node: one actor per GPU (`NodeWorker`).

The actor starts the same worker program as the local backend (launcher/child.py: `python
-P`, a scrubbed environment, SIGTERM when its parent, the actor, dies) in the node's own
directory, with the same worker settings; then, asked by the launcher once per poll, it
hands over the complete metrics lines the worker appended (the launcher writes them into
the pod directory on the head, where the supervisor reads them as on one machine).

Checkpoints stay on the node's disk: each checkpoint event is hard-linked at once
(launcher.pod.ckpt_index, as on the head) so the worker's rotation cannot delete it before the
launcher judges it; a checkpoint that passed is pushed from here to the hub, which is what
carries weights between machines, as the head's pod (`writer`: the run's hub lease, so a
node of a pod whose run was taken over by `launch --from-hub` elsewhere is refused,
RunTakenOver, and overwrites nothing). A worker starts only from the bytes its manifest entry
records: where the named file holds others (a final save written over it on SIGTERM that the
launcher had not recorded yet), from this node's own copy of them, as on one machine;
a GPU placed on a node that lacks its checkpoint pulls it from the hub revision the launcher
names (sha256-verified) before the worker starts; bytes found nowhere fail the start
(BytesNowhere), and the launcher decides where the GPU goes back to (RayCustodian.restore).
With `data:` in the pod config, the node likewise puts its GPU's shards (its current data
phase's and every later one's) in its own directory before the worker starts: verified
against the data store's record at the pinned revision, fetched when absent (resumable;
launcher/hub/fetch.py), with this node's own credentials as for the hub. The launcher's
machine fetches none of them: a node holds only its own GPUs' shards.

AR probes (launcher/checks/probe_monitor.py) of a checkpoint run here, where the file is:
the same probe program in a child process (launcher/checks/probe_check.py), its result
handed back to the launcher, which judges it. A checkpoint is named `sha256:HEX` (the
retained link of one this actor saw), or `resume`: the one its worker started from,
linked at start because the worker saves over it.

Fencing: a node that stops hearing from its launcher stops its worker. The launcher sends
every actor a heartbeat every few seconds (RayBackend), carrying the deadlines to keep (its
fence and a fenced worker's grace, launcher/supervise/ray_fence.py; `fence_s`, `grace_s`
until the first one); an actor that has heard nothing for its fence (a partition, a
SIGSTOPped raylet, the launcher killed) SIGTERMs its worker (the worker saves its final
checkpoint on this disk and exits; SIGKILL after the grace) and then exits itself. The
launcher counts the same deadline from its last heartbeat the node may have heard and
places the GPU elsewhere only after it, so two workers never train one GPU. The actors are
detached (a driver that dies does not take them down with a SIGKILL of every child, which is
what Ray does to an owned actor): a launcher killed with -9 leaves each worker its final
save, within its fence and grace.

Imported on the nodes by Ray; imports nothing of Ray at module level.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import psutil

from launcher import child
from launcher.paths import NODE_LEASE_DIR, PROBE_DIR, worker_log_path
from launcher.pod.ckpt_index import FAILED, PASSED, CheckpointIndex, link_or_copy
from launcher.pod.failed_resume import set_aside
from launcher.pod.manifest import event_position, relative_to_pod
from launcher.worker.process import MetricsTail, kill, terminate, worker_env
from launcher.hub import open_store
from launcher.hub.recover import holds, local_copy, retained_copy
from launcher.hub.lease import push_as_writer
from launcher.supervise.ray_recovery import new_attempt, start_pusher
from launcher.checks.probe_check import ProbeUnavailable, run_probe_process
from launcher.config.data_settings import DataSource
from launcher.hub.fetch import ensure_shards
from launcher.supervise.ray_recovery import check_save_apart, is_recovery

# Settings resolved against the node's directory, else the head's pod directory (the same
# machine or a shared filesystem): shards (without `data:`) and a model file are the
# user's to place.
NODE_LOCAL_INPUTS = ("SHARD", "MODEL")
RESUME = "resume"               # a probe's name for the checkpoint the worker started from
RECOVERED, PULLED = "recovered", "pulled"   # how a start's checkpoint bytes came to the node
FENCE_CHECK_S = 1.0             # how often an actor looks at its last heartbeat
ADOPT_CHECK_S = 0.2             # how often `adopt` looks whether the previous worker ended


class NodeWorker:
    def __init__(self, gpu: int, workdir: str, pod_dir: str, hub_url: str | None,
                 writer: str | None, command: list[str], fence_s: float, grace_s: float,
                 data: dict | None = None, recovery_every_s: float = 0.0):
        import ray      # optional (the ray extra): only a launch --ray imports it
        self.node_id = ray.get_runtime_context().get_node_id()   # for NodeAffinity
        self.node = self.node_id[:12]
        self.gpu, self.hub_url, self.command = gpu, hub_url, command
        self.data = data                  # the pod's data source {url, revision}, or None
        self.writer = writer              # the head's pod id: its nodes push as that pod
        self.pod_dir = Path(pod_dir)
        self.workdir = Path(workdir.format(node=self.node, pod=pod_dir))
        (self.workdir / "logs").mkdir(parents=True, exist_ok=True)
        self.index = CheckpointIndex(self.workdir)   # this node's retained checkpoints
        self.proc: subprocess.Popen | None = None
        self.tail: MetricsTail | None = None     # the running worker's METRICS file
        self.lock = threading.Lock()      # poll and push run on two actor threads
        self.resume_file: Path | None = None   # held for the stage's baseline probe
        self.pushers: list[subprocess.Popen] = []   # recovery pushers (ray_recovery.py)
        # Set once start() has placed the worker: the actor's methods run on several
        # threads, and a probe of the resume checkpoint must wait for its pull and hold.
        self.placed = threading.Event()
        self.fence_s, self.grace_s = fence_s, grace_s
        self.fence_grace_s = grace_s      # a fenced worker's; the heartbeats may shorten it
        # Each GPU's share of the hub's commit budget for recovery copies (ray_recovery.py)
        self.recovery_every_s = recovery_every_s
        self.heard = time.monotonic()     # the launcher's last call (heartbeat or start)
        threading.Thread(target=self._fence, name="fence", daemon=True).start()

    # ---- the worker --------------------------------------------------------------------
    def start(self, settings: dict[str, str], checkpoint: dict | None, cuda: bool,
              keep: list[str] = (), shards: list[str] = (), start_over: bool = False) -> dict:
        """Start the worker with `settings` (the launcher's worker environment); first put
        `shards` (pod-relative) in place from the data source, and pull `checkpoint`
        ({"path", "sha256", "revision"}) from the hub, where this disk lacks them.
        `start_over`: nothing the GPU wrote passed and it starts over at token 0 (the
        launcher's rule, launcher/pod/failed_resume.py): its own files on this node, which
        the worker would otherwise resume from (CKPT_OUT) and refuse, are renamed
        `NAME.failed` first, as on one machine."""
        try:
            return self._start(settings, checkpoint, cuda, keep, shards, start_over)
        finally:
            self.placed.set()       # a probe waiting for the start goes on, whatever it did

    def _start(self, settings: dict[str, str], checkpoint: dict | None, cuda: bool,
               keep: list[str], shards: list[str], start_over: bool) -> dict:
        import ray      # optional, as above
        self.heard = time.monotonic()
        fetched = self._ensure_shards(shards)
        moved = set_aside(self.workdir, settings["CKPT_OUT"]) if start_over else []
        if moved:
            self._note(f"starts over at token 0 (nothing it wrote passed): set aside "
                       f"{', '.join(moved)} as NAME.failed")
        resume, how = None, None
        if checkpoint:
            token = settings.get("START_TOKEN")
            resume, how = self._ensure_checkpoint(checkpoint, int(token) if token else 0)
            settings = {**settings, "CKPT_IN": resume}
            self._check_recovery_copy(resume, settings)
            self._hold_resume(self.workdir / resume)
        # Scrubbed here, on the node's own environment; `keep`: the names the pod config
        # passes (pass_env), taken from this node's environment as on one machine.
        env = worker_env(os.environ, settings, keep=keep)
        for name in NODE_LOCAL_INPUTS:
            if env.get(name):
                env[name] = self._input(env[name])
        if cuda:       # the device Ray gave this actor, not the GPU's index on the head
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(int(i)) for i in ray.get_gpu_ids())
        with self.lock:
            self.tail = MetricsTail(self.workdir / settings["METRICS"])
            log_path = self.workdir / worker_log_path(self.gpu)
            with open(log_path, "ab") as log:
                self.proc = child.spawn(self.command, cwd=self.workdir, env=env, keep=keep,
                                        stdout=log, stderr=subprocess.STDOUT,
                                        death_signal=signal.SIGTERM)
            attempt = self._start_recovery_pushes(settings, log_path)
        return {"pid": self.proc.pid, "node": self.node, "node_id": self.node_id,
                "workdir": str(self.workdir), "pulled": how == PULLED, "fetched": fetched,
                "attempt": attempt, "recovered": resume if how == RECOVERED else None,
                "set_aside": moved}

    def _start_recovery_pushes(self, settings: dict[str, str], log_path: Path) -> str | None:
        """The pusher of this worker start's saves (launcher/supervise/ray_recovery.py), in
        a process that outlives this actor; the start's id, which its pushes carry."""
        self.pushers = [p for p in self.pushers if p.poll() is None]     # reap the ended
        if not (self.hub_url and self.writer):
            return None
        attempt = new_attempt()
        try:
            create_time = psutil.Process(self.proc.pid).create_time()
        except psutil.NoSuchProcess:
            return None             # ended at once: nothing it saved to push
        self.pushers.append(start_pusher(
            {"gpu": self.gpu, "workdir": str(self.workdir), "metrics": settings["METRICS"],
             "offset": self.tail.position, "pid": self.proc.pid, "create_time": create_time,
             "hub_url": self.hub_url, "writer": self.writer, "attempt": attempt,
             "run_id": settings.get("RUN_ID"), "node": self.node,
             "gpu_commit_every_s": self.recovery_every_s},
            self.workdir, log_path))
        return attempt

    def heartbeat(self, fence_s: float | None = None, grace_s: float | None = None) -> None:
        """The launcher is there (RayBackend's heartbeat thread, every HEARTBEAT_S), and
        says the deadlines to keep from now (ray_fence.Deadlines, derived from what it
        measured): the fence, and the time a fenced worker has to stop."""
        self.heard = time.monotonic()
        if fence_s is not None and grace_s is not None:
            self.fence_s, self.fence_grace_s = float(fence_s), float(grace_s)

    def _fence(self) -> None:
        """Stop the worker, then this actor, once the launcher has been silent for fence_s:
        the launcher places the GPU elsewhere after the same deadline (plus grace_s) counted
        from its side, so the two never overlap."""
        while time.monotonic() - self.heard < self.fence_s:
            time.sleep(FENCE_CHECK_S)
        silent = time.monotonic() - self.heard
        proc = self.proc
        self._note(f"fenced: no heartbeat from the launcher for {silent:.0f}s (fence "
                   f"{self.fence_s:g}s); stopping the worker (SIGTERM: it saves its final "
                   f"checkpoint on this node; SIGKILL after {self.fence_grace_s:g}s)")
        if proc is not None:
            terminate([proc], self.fence_grace_s)
            self._note(f"fenced: worker pid {proc.pid} ended with code {proc.returncode}; "
                       f"the actor exits")
        os._exit(0)        # nobody will call it again: its resources go back to the cluster

    def _note(self, text: str) -> None:
        """A line in the GPU's worker log on this node."""
        with open(self.workdir / worker_log_path(self.gpu), "a") as log:
            log.write(f"[fractus-pod {time.strftime('%Y-%m-%d %H:%M:%S')}] {text}\n")

    def _input(self, value: str) -> str:
        """A file setting as this node finds it: in its own directory, else the head's pod
        directory (the same machine or a shared filesystem), else as given."""
        if not (self.workdir / value).exists() and (self.pod_dir / value).exists():
            return str(self.pod_dir / value)
        return value

    def poll(self) -> tuple[int | None, bytes, int]:
        """(exit code or None, the complete metrics lines written since the last poll, the
        byte offset of the metrics file they end at: where a replacement actor of this GPU
        on this node goes on reading if this one dies, see `adopt`)."""
        with self.lock:
            code = self.proc.poll() if self.proc is not None else None
            lines = self._new_lines()          # after the exit code: nothing is left behind
            return code, lines, self.tail.position if self.tail is not None else 0

    def adopt(self, pid: int, metrics: str, offset: int) -> tuple[int | None, bytes]:
        """Take over from this GPU's previous actor on this node, whose process died while
        the node lives: its worker `pid` got SIGTERM with it and saves its final checkpoint;
        wait for it to end (SIGKILL after grace_s: never two workers of one GPU), then hand
        over the metrics lines it wrote past `offset` (its final checkpoint event among them,
        retained here), so that the GPU resumes from this node's newest checkpoint."""
        deadline = time.monotonic() + self.grace_s
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(ADOPT_CHECK_S)
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
            while _alive(pid):
                time.sleep(ADOPT_CHECK_S)
        self.heard = time.monotonic()
        with self.lock:
            self.tail = MetricsTail(self.workdir / metrics, offset=offset)
            return None, self._new_lines()

    def signal(self, signum: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signum)

    def kill(self) -> tuple[int | None, bytes]:
        with self.lock:
            if self.proc is not None:
                kill(self.proc)
            return (self.proc.returncode if self.proc else None), self._new_lines()

    def terminate(self, grace_s: float) -> tuple[int | None, bytes]:
        """SIGTERM (the worker checkpoints), SIGKILL after grace_s."""
        if self.proc is not None:
            terminate([self.proc], grace_s)
        with self.lock:
            return (self.proc.returncode if self.proc else None), self._new_lines()

    def _new_lines(self) -> bytes:
        lines = self.tail.read_lines() if self.tail is not None else []
        return b"".join(self._seen(line) + b"\n" for line in lines)

    def _seen(self, line: bytes) -> bytes:
        """Retain a checkpoint the moment its event is read; the head gets the event
        without its size, so that a file of the same name on the head's disk is only
        ever trusted by its sha256, and with whether this node could retain it."""
        if b'"checkpoint"' not in line:
            return line
        try:
            event = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return line
        if event.get("event") != "checkpoint" or "sha256" not in event:
            return line
        rel = relative_to_pod(event["path"], self.workdir)
        record = self.index.add(self.gpu, event, int(event.get("stage") or 0), rel)
        event.pop("bytes", None)
        event["path"], event["node"] = rel, self.node
        # Read too late to pin its bytes (rotated past SAVE_KEEP): the head probes none.
        event["retained"] = bool(record.get("retained"))
        return json.dumps(event).encode()

    # ---- AR probes ---------------------------------------------------------------------
    def _hold_resume(self, source: Path) -> None:
        held = self.workdir / PROBE_DIR / f"gpu{self.gpu}-{RESUME}.pt"
        link_or_copy(source, held)
        self.resume_file = held

    def probe(self, checkpoint: str, shard: str, **options) -> dict:
        """The AR probe of this node's `checkpoint` (`sha256:HEX` or `resume`) on `shard`:
        its result dict, with this node's id; ProbeUnavailable when it cannot run."""
        self.placed.wait(options.get("timeout_s") or None)
        path = self._probe_file(checkpoint)
        if path is None or not path.is_file():
            raise ProbeUnavailable(f"checkpoint {checkpoint} is not retained on node "
                                   f"{self.node}")
        if options.get("model"):
            options["model"] = self._input(options["model"])
        result = run_probe_process(path, self._input(shard), cwd=self.workdir, **options)
        return {**result, "node": self.node}

    def _probe_file(self, checkpoint: str) -> Path | None:
        if checkpoint == RESUME:
            return self.resume_file
        record = self.index.records.get((self.gpu, checkpoint.removeprefix("sha256:")))
        if record is None:
            return None
        # Only pinned bytes: the worker's own name may hold a newer save (RotatedAway).
        return self.workdir / record["retained"] if record.get("retained") else None

    # ---- the hub -------------------------------------------------------------------------
    def push(self, sha256: str, hub_path: str, message: str) -> str:
        """Push this node's retained checkpoint `sha256` to `hub_path` (checked against its
        sha256 in the one read the push makes); older unpushed links are let go.
        RunTakenOver when another pod holds the run's lease."""
        record = self.index.records[(self.gpu, sha256)]
        if not record.get("retained"):
            raise RotatedAway(f"checkpoint {sha256[:12]} (token {record['next_token']:,}) was "
                              f"rotated away before node {self.node} retained it")
        local = self.workdir / record["retained"]
        revision = push_as_pod(self.hub_url, self.workdir, self.writer, hub_path, local,
                               sha256, message)
        with self.lock:
            for older in self.index.pending(self.gpu):
                if event_position(older) < event_position(record):
                    self.index.mark(self.gpu, older["sha256"], FAILED,
                                    "superseded: a newer checkpoint passed on the launcher")
            self.index.mark(self.gpu, sha256, PASSED, f"pushed as {revision}")
        return revision

    def _ensure_shards(self, shards: list[str]) -> list[str]:
        """The GPU's shards verified in this node's directory (fetched where absent): the
        shards fetched. A store that cannot be read or other bytes: UserError/HubError,
        the worker's start fails with that one line."""
        if not (self.data and shards):
            return []
        return ensure_shards(list(shards), DataSource(**self.data), self.workdir)

    def _check_recovery_copy(self, path: str, settings: dict[str, str]) -> None:
        """A recovery copy (pushed before any probe) is checked again before a worker
        resumes from it: it loads weights-only, is this GPU's, of this run, at the entry's
        token, with finite weights (ValueError, one line: the start fails)."""
        if is_recovery(path):
            token = settings.get("START_TOKEN")
            check_save_apart(self.workdir / path, self.gpu,
                             settings.get("RUN_ID"), int(token) if token else None)

    def _ensure_checkpoint(self, checkpoint: dict, token: int) -> tuple[str, str | None]:
        """The file the worker resumes from (relative to this node's directory), holding
        the bytes the launcher's entry records (its sha256), and how they got there: None
        (at the named path), RECOVERED (the named file holds other bytes or is gone, and a
        copy on this node holds them: its retained link, or a rotated copy, retained now,
        as on one machine, launcher/hub/recover.py; e.g. the worker's final save on a
        SIGTERM, over the named file, before the launcher recorded it), or PULLED (from
        the hub revision the entry names, verified). Nowhere: BytesNowhere, one line,
        the start fails: a worker never starts on bytes its entry does not record (it would
        refuse them, and the pod would fail). An entry without a sha256 (a manifest the
        launcher never wrote) has nothing to check: its file as it is."""
        name, sha256 = checkpoint["path"], checkpoint.get("sha256")
        target = self.workdir / name
        if target.is_file() and (not sha256 or holds(target, sha256)):
            return name, None
        if sha256:
            copy = local_copy(self.workdir, self.gpu, target, sha256, self.index, name)
            if copy is not None:
                return (retained_copy(self.workdir, self.gpu, token, sha256, self.index, copy),
                        RECOVERED)
        if self.hub_url and checkpoint.get("revision"):
            open_store(self.hub_url, self.workdir).pull([name],
                                                        revision=checkpoint["revision"])
            return name, PULLED
        state = "holds other bytes" if target.is_file() else "is missing"
        raise BytesNowhere(f"{name} {state} on node {self.node}, and no copy there and "
                           f"no hub revision holds the bytes its manifest entry records"
                           f" (sha256 {(sha256 or '')[:12]})")


def _alive(pid: int) -> bool:
    """The process runs (a zombie has ended: it only waits to be reaped)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def push_as_pod(hub_url: str, workdir: Path, writer: str, hub_path: str, local: Path,
                sha256: str, message: str) -> str:
    """Push a node's `local` checkpoint to `hub_path` (checked against `sha256`) as the pod
    `writer`, carrying the run's lease (launcher/hub/lease.py), staged on the node's
    `workdir`: RunTakenOver, nothing committed, once another pod holds the run."""
    return push_as_writer(open_store(hub_url, workdir), {hub_path: local}, message,
                          {hub_path: sha256}, workdir / NODE_LEASE_DIR, writer)


class BytesNowhere(FileNotFoundError):
    """The bytes a worker start's manifest entry records are on neither this node nor the
    hub: the start fails, and the launcher decides where the GPU goes back to
    (RayCustodian.restore: its newest passed checkpoint)."""


class RotatedAway(RuntimeError):
    """A passed checkpoint without a retained link on this node: its event was read after
    the worker had saved past SAVE_KEEP, so the worker's own name holds newer bytes (a
    probe there would judge another checkpoint, a push would be refused by its sha256).
    The GPU's next checkpoint serves instead."""
