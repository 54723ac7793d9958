"""The checkpoints of one GPU on the Ray node that wrote them.

Invariant: a worker starts only from the bytes its manifest entry records, and what the
launcher judges is what it names. Each checkpoint is hard-linked the moment its event is
read (`seen`), so rotation cannot take it first. Owner: `NodeCheckpoints`, which NodeWorker
holds.
"""

from __future__ import annotations

import json
import subprocess
import threading
from pathlib import Path

import psutil

from launcher.checks.probe_check import ProbeUnavailable, run_probe_process
from launcher.config.data_settings import DataSource
from launcher.hub import open_store
from launcher.hub.fetch import ensure_shards
from launcher.hub.lease import push_as_writer
from launcher.hub.recover import holds, local_copy, retained_copy
from launcher.paths import NODE_LEASE_DIR, PROBE_DIR
from launcher.pod.ckpt_index import FAILED, PASSED, CheckpointIndex, link_or_copy
from launcher.pod.failed_resume import set_aside
from launcher.pod.manifest import event_position, relative_to_pod
from launcher.supervise.ray.recovery import (check_save_apart, is_recovery, new_attempt,
                                             start_pusher)

RESUME = "resume"               # a probe's name for the checkpoint the worker started from
RECOVERED, PULLED = "recovered", "pulled"   # how a start's checkpoint bytes came to the node


class NodeCheckpoints:
    def __init__(self, gpu: int, node: str, workdir: Path, pod_dir: Path,
                 hub_url: str | None, writer: str | None, data: dict | None,
                 recovery_every_s: float):
        self.gpu, self.node, self.workdir, self.pod_dir = gpu, node, workdir, pod_dir
        self.hub_url, self.writer = hub_url, writer   # writer: the head's pod id
        self.data = data                  # the pod's data source {url, revision}, or None
        self.recovery_every_s = recovery_every_s      # each GPU's share of the commits
        self.index = CheckpointIndex(workdir)   # this node's retained checkpoints
        self.lock = threading.Lock()      # the index: poll and push run on two threads
        self.resume_file: Path | None = None   # held for the stage's baseline probe
        self.pushers: list[subprocess.Popen] = []   # recovery pushers
        # a probe of the resume checkpoint waits for the start's pull and hold
        self.placed = threading.Event()

    def prepare(self, settings: dict[str, str], checkpoint: dict | None,
                shards: list[str], start_over: bool, note) -> tuple[dict[str, str], dict]:
        """Before the worker starts: shards in place, own files set aside when it starts over
        (launcher/pod/failed_resume.py), the resume file holding its entry's bytes. Returns
        its settings (CKPT_IN as found here) and what the start reports."""
        fetched = self._ensure_shards(shards)
        moved = set_aside(self.workdir, settings["CKPT_OUT"]) if start_over else []
        if moved:
            note(f"starts over at token 0 (nothing it wrote passed): set aside "
                 f"{', '.join(moved)} as NAME.failed")
        resume, how = None, None
        if checkpoint:
            token = settings.get("START_TOKEN")
            resume, how = self._ensure_checkpoint(checkpoint, int(token) if token else 0)
            settings = {**settings, "CKPT_IN": resume}
            if is_recovery(resume):       # pushed before any probe: checked again
                check_save_apart(self.workdir / resume, self.gpu, settings.get("RUN_ID"),
                                 int(token) if token else None)
            self.resume_file = self.workdir / PROBE_DIR / f"gpu{self.gpu}-{RESUME}.pt"
            link_or_copy(self.workdir / resume, self.resume_file)
        return settings, {"pulled": how == PULLED, "fetched": fetched, "set_aside": moved,
                          "recovered": resume if how == RECOVERED else None}

    def input(self, value: str) -> str:
        """A file setting as found here: this node's directory, the head's pod dir, or as is."""
        if not (self.workdir / value).exists() and (self.pod_dir / value).exists():
            return str(self.pod_dir / value)
        return value

    def start_recovery_pushes(self, pid: int, settings: dict[str, str], offset: int,
                              log_path: Path) -> str | None:
        """Start this worker start's recovery pusher; returns the start's id (`attempt`)."""
        self.pushers = [p for p in self.pushers if p.poll() is None]     # reap the ended
        if not (self.hub_url and self.writer):
            return None
        attempt = new_attempt()
        try:
            create_time = psutil.Process(pid).create_time()
        except psutil.NoSuchProcess:
            return None             # ended at once: nothing it saved to push
        self.pushers.append(start_pusher(
            {"gpu": self.gpu, "workdir": str(self.workdir), "metrics": settings["METRICS"],
             "offset": offset, "pid": pid, "create_time": create_time,
             "hub_url": self.hub_url, "writer": self.writer, "attempt": attempt,
             "run_id": settings.get("RUN_ID"), "node": self.node,
             "gpu_commit_every_s": self.recovery_every_s},
            self.workdir, log_path))
        return attempt

    def seen(self, line: bytes) -> bytes:
        """Retain a checkpoint the moment its event is read. The head gets the event without
        its size (a same-named file on the head is trusted only by sha256) and with
        `retained`."""
        if b'"checkpoint"' not in line:
            return line
        try:
            event = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return line
        if event.get("event") != "checkpoint" or "sha256" not in event:
            return line
        rel = relative_to_pod(event["path"], self.workdir)
        with self.lock:
            record = self.index.add(self.gpu, event, int(event.get("stage") or 0), rel)
        event.pop("bytes", None)
        event["path"], event["node"] = rel, self.node
        # Read too late to pin its bytes (rotated past SAVE_KEEP): the head probes none.
        event["retained"] = bool(record.get("retained"))
        return json.dumps(event).encode()

    def probe(self, checkpoint: str, shard: str, **options) -> dict:
        """The AR probe of this node's `checkpoint` (`sha256:HEX` or `resume`) on `shard`:
        its result dict, with this node's id; ProbeUnavailable when it cannot run."""
        self.placed.wait(options.get("timeout_s") or None)
        path = self._probe_file(checkpoint)
        if path is None or not path.is_file():
            raise ProbeUnavailable(f"checkpoint {checkpoint} is not retained on node "
                                   f"{self.node}")
        if options.get("model"):
            options["model"] = self.input(options["model"])
        result = run_probe_process(path, self.input(shard), cwd=self.workdir, **options)
        return {**result, "node": self.node}

    def _probe_file(self, checkpoint: str) -> Path | None:
        if checkpoint == RESUME:
            return self.resume_file
        record = self.index.records.get((self.gpu, checkpoint.removeprefix("sha256:")))
        if record is None:
            return None
        # Only pinned bytes: the worker's own name may hold a newer save (RotatedAway).
        return self.workdir / record["retained"] if record.get("retained") else None

    def push(self, sha256: str, hub_path: str, message: str) -> str:
        """Push this node's retained checkpoint `sha256` to `hub_path`; older pending ones
        are marked failed (superseded). RunTakenOver when another pod holds the lease."""
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
        """The GPU's shards verified here, fetched where absent; returns those fetched."""
        if not (self.data and shards):
            return []
        return ensure_shards(list(shards), DataSource(**self.data), self.workdir)

    def _ensure_checkpoint(self, checkpoint: dict, token: int) -> tuple[str, str | None]:
        """The resume file (node-relative) holding the entry's bytes, and how: None (the
        named path), RECOVERED (a copy on this node, launcher/hub/recover.py) or PULLED
        (the entry's hub revision). Nowhere: BytesNowhere. No sha256: the file as it is."""
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


def push_as_pod(hub_url: str, workdir: Path, writer: str, hub_path: str, local: Path,
                sha256: str, message: str) -> str:
    """Push `local` to `hub_path` as the pod `writer` under the run's lease (RunTakenOver)."""
    return push_as_writer(open_store(hub_url, workdir), {hub_path: local}, message,
                          {hub_path: sha256}, workdir / NODE_LEASE_DIR, writer)


class BytesNowhere(FileNotFoundError):
    """A start's entry bytes are on neither this node nor the hub: the start fails and the
    launcher decides (RayCustodian.restore)."""


class RotatedAway(RuntimeError):
    """A passed checkpoint read after the worker saved past SAVE_KEEP: its name holds newer
    bytes, so it can be neither probed nor pushed; the GPU's next checkpoint serves."""
