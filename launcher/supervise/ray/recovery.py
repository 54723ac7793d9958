"""Recovery copies on a Ray pod: each save of a node's workers goes to the hub before any probe.

Invariant: the hub holds, for each GPU of a node, a recovery copy no older than the node's
last commit, within the pod's share of the hub's commit budget (launcher/hub/commit_budget.py);
the launcher takes a copy only of the worker start it lost (`attempt`), never of an earlier
lineage; a recovery copy is never in a manifest. Owner: the node's pushers
(`RecoveryPusher`, one per worker start, in a session of its own so that a graceful
removal's final save goes up too); the launcher reads them (`read_recovery_copy`). The
cadence and the recovery point: docs/LAUNCHER.md, Multi-node pods on Ray, Recovery copies.
"""

from __future__ import annotations

import fcntl
import importlib
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil

from launcher import child
from launcher.files import read_json_state, write_json_state
from launcher.paths import (RECOVERY_COMMIT_LOCK, RECOVERY_COMMIT_STATE, RECOVERY_HUB_DIR,
                            RECOVERY_POSTED_PREFIX, RECOVERY_PUSHER_PREFIX,
                            RECOVERY_SENDING_PREFIX, RECOVERY_STAGING_DIR)
from launcher.worker.process import MetricsTail
from launcher.pod.ckpt_trust import read_identity
from launcher.pod.ckpt_index import link_or_copy
from launcher.pod.manifest import relative_to_pod
from launcher.hub import HubError, open_store
from launcher.hub.integrity import IntegrityError
from launcher.hub.lease import RunTakenOver, push_as_writer
from launcher.paths import NODE_LEASE_DIR
from launcher.supervise.ray.recovery_staging import (DUE_CHECK_S, commit_due, gpu_commit_every_s,
                                                     newest_per_gpu, posted, remove_entry)

RECORD_FORMAT = "fractus-recovery/1"
TAIL_S = 0.2       # how often the pusher reads the metrics file: part of the recovery point
FINAL_PUSH_S = 600.0                      # after its worker ended: the final push's time
RETRY_S = (2.0, 30.0)                     # a failed push is tried again: first, longest wait
CHECK_FLAG = "--check"                    # `python -m ...ray.recovery --check SPEC`: check_save
CHECK_TIMEOUT_S = 600.0                   # a 1B save loaded weights-only from a slow disk


def recovery_path(checkpoint: str) -> str:
    """The hub path of `checkpoint`'s (pod-relative) recovery copy."""
    return f"{RECOVERY_HUB_DIR}/{checkpoint}"


def record_path(checkpoint: str) -> str:
    return recovery_path(checkpoint) + ".json"


def is_recovery(path: str) -> bool:
    return path.startswith(RECOVERY_HUB_DIR + "/")


def new_attempt() -> str:
    return uuid.uuid4().hex[:16]


def check_save(path: Path, gpu: int, run_id: str | None, next_token: int | None) -> None:
    """The cheap checks of a save (no probe): ValueError, one line, when it does not load
    weights-only, is another GPU's or run's, is at another token, or holds NaN/Inf."""
    import torch       # ~2 s: only when a save is checked

    found = read_identity(path)
    if found.gpu is not None and found.gpu != gpu:
        raise ValueError(f"{path.name} was written by GPU {found.gpu}, not GPU {gpu}")
    if found.run_id is not None and run_id and found.run_id != run_id:
        raise ValueError(f"{path.name} belongs to run {found.run_id}, not {run_id}")
    if None not in (found.next_token, next_token) and found.next_token != next_token:
        raise ValueError(f"{path.name} resumes at token {found.next_token}, its event says "
                         f"{next_token}")
    from fractus.train.checkpoint import load_checkpoint
    state = load_checkpoint(path)["model_state"]
    for key, tensor in state.items():
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() \
                and not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{path.name} holds NaN/Inf in {key}")


def check_save_apart(path: Path, gpu: int, run_id: str | None, next_token: int | None,
                     timeout_s: float = CHECK_TIMEOUT_S) -> None:
    """`check_save` in a child process: loading torch in a node actor holds the interpreter
    for seconds, long enough to miss heartbeats and fence itself."""
    spec = {"path": str(path), "gpu": gpu, "run_id": run_id, "next_token": next_token}
    try:
        done = child.run(child.python_command("-m", "launcher.supervise.ray.recovery",
                                              CHECK_FLAG, json.dumps(spec)),
                         cwd=path.parent, env=_launcher_env(), timeout_s=timeout_s)
    except subprocess.TimeoutExpired:
        raise ValueError(f"{path.name} could not be checked within {timeout_s:g}s") from None
    if done.returncode != 0:
        said = [line for line in done.stderr.splitlines() if line.strip()]
        raise ValueError(said[-1] if said else f"{path.name}: the check exited "
                                               f"{done.returncode}")


# ---- the launcher's side -------------------------------------------------------------------
def read_recovery_copy(hub_url: str, pod_dir: Path, checkpoint: str, gpu: int,
                       attempt: str | None) -> dict | None:
    """The GPU's recovery copy on the hub's newest revision, as a checkpoint-index record
    plus `hub_revision` and `recovery: True`; None when none is of worker start `attempt`.
    Reads the record only (the resuming node pulls and checks the weights). HubError/
    OSError/ValueError when the hub cannot be read."""
    if not attempt:
        return None
    store = open_store(hub_url, pod_dir)
    head = store.head()
    if head is None:
        return None
    index = store.files(head)
    path, record = recovery_path(checkpoint), record_path(checkpoint)
    if path not in index or record not in index:
        return None
    with store.fetched(record, head, index[record].sha256) as local:
        doc = json.loads(Path(local).read_text())
    if doc.get("format") != RECORD_FORMAT or doc.get("attempt") != attempt \
            or doc.get("gpu") != gpu or doc.get("sha256") != index[path].sha256:
        return None           # another start's, another GPU's, or a pair torn apart
    return {**{k: doc[k] for k in ("next_token", "phase", "ema_tf", "lb", "step")
               if k in doc},
            "sha256": doc["sha256"], "path": path, "hub_revision": head, "node": doc.get("node"),
            "recovery": True}


# ---- the node's side -----------------------------------------------------------------------
def start_pusher(spec: dict, workdir: Path, log_path: Path) -> subprocess.Popen:
    """The pusher of one worker start, in its own session: the actor's death does not end it."""
    with open(log_path, "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "launcher.supervise.ray.recovery",
                                 json.dumps(spec)], cwd=workdir, env=_launcher_env(),
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _launcher_env() -> dict[str, str]:
    """This node's environment, with the launcher package's home on PYTHONPATH."""
    root = str(Path(__file__).resolve().parents[3])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    return env


class RecoveryPusher:
    """`spec`: gpu, workdir, metrics (file), offset (where this start's lines begin), pid and
    create_time (the worker), hub_url, writer (the head's pod id), attempt, run_id, node,
    gpu_commit_every_s (None: derived from the hub's budget)."""

    def __init__(self, spec: dict):
        self.spec = spec
        self.gpu = int(spec["gpu"])
        self.workdir = Path(spec["workdir"])
        self.staging = self.workdir / RECOVERY_STAGING_DIR
        self.tail = MetricsTail(self.workdir / spec["metrics"], offset=int(spec["offset"]))
        self.waiting: tuple[dict, Path] | None = None     # the newest save not posted yet
        self.stopped = False              # the run was taken over: nothing more goes up
        self.ended = False                # its worker has ended: its saves go up at once
        self.next_check = 0.0             # monotonic: when to look whether a commit is due

    def run(self) -> None:
        importlib.import_module("torch")     # now: the first save waits for no import
        self._register()
        ended_at = None
        try:
            while not self.stopped and self.workdir.is_dir():   # a node directory removed
                alive = self._worker_alive()
                self._read()            # after the liveness check: the final save is read
                if not alive and not self.ended:
                    self.ended = True
                    self._mark_final()
                posted = self.waiting is not None
                if posted:
                    self._post_waiting()
                self._commit_if_due(force=posted or not alive)
                if not alive:
                    if not self._own_posted():
                        return
                    ended_at = ended_at or time.monotonic()
                    if time.monotonic() - ended_at > FINAL_PUSH_S:
                        self._note("gave up pushing the final save's recovery copy")
                        for entry in self._own_posted():
                            remove_entry(entry)
                        return
                time.sleep(TAIL_S)
        finally:
            self._registration().unlink(missing_ok=True)

    def _worker_alive(self) -> bool:
        try:
            proc = psutil.Process(int(self.spec["pid"]))
            return proc.create_time() == self.spec["create_time"] \
                and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def _read(self) -> None:
        for line in self.tail.read_lines():
            if b'"checkpoint"' not in line:
                continue
            try:
                event = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
            if event.get("event") != "checkpoint" or "sha256" not in event:
                continue
            rel = relative_to_pod(event["path"], self.workdir)
            link = self.staging / f"gpu{self.gpu}-{event['sha256'][:16]}.pt"
            try:
                link_or_copy(self.workdir / rel, link)
            except OSError:
                continue            # rotated away already: a newer save follows
            self._drop_waiting()
            self.waiting = ({**event, "path": rel}, link)

    def _drop_waiting(self) -> None:
        if self.waiting is not None:
            self.waiting[1].unlink(missing_ok=True)
            self.waiting = None

    def _push_waiting(self) -> bool:
        """Post the waiting save and commit if due; always True (a failed commit is retried)."""
        if self.waiting is not None:
            self._post_waiting()
        self._commit_if_due(force=True)
        return True

    # ---- posting: each GPU's newest checked save waits for the node's next commit ----
    def _registration(self) -> Path:
        return self.staging / f"{RECOVERY_PUSHER_PREFIX}{self.gpu}-{self.spec['attempt']}.json"

    def _register(self) -> None:
        """This GPU counts toward the node's cadence while its pusher runs."""
        write_json_state(self._registration(),
                         {"gpu": self.gpu, "pid": os.getpid(),
                          "create_time": psutil.Process().create_time()})

    def _post_waiting(self) -> None:
        event, link = self.waiting
        token = int(event["next_token"])
        try:
            check_save(link, self.gpu, self.spec.get("run_id"), token)
        except ValueError as exc:
            self._note(f"save at token {token:,} not pushed as a recovery copy: {exc}")
            self._drop_waiting()
            return
        doc = {"format": RECORD_FORMAT, "gpu": self.gpu, "sha256": event["sha256"],
               "next_token": token, "attempt": self.spec["attempt"], "node": self.spec["node"],
               "saved_at": event.get("ts"),
               **{k: event[k] for k in ("phase", "ema_tf", "lb", "step") if k in event}}
        name = f"{RECOVERY_POSTED_PREFIX}{self.gpu}-{self.spec['attempt']}-{event['sha256'][:16]}"
        link_or_copy(link, self.staging / f"{name}.pt")
        write_json_state(self.staging / f"{name}.json",       # last: the entry is complete
                         {"record": doc, "hub_path": recovery_path(event["path"]),
                          "final": self.ended, "posted_at": time.time()})
        for entry in posted(self.staging):          # this GPU's older saves: superseded
            if entry["gpu"] == self.gpu and entry["name"] != name:
                remove_entry(entry)
        self._drop_waiting()

    def _own_posted(self) -> list[dict]:
        return [e for e in posted(self.staging)
                if e["gpu"] == self.gpu and e["record"]["attempt"] == self.spec["attempt"]]

    def _mark_final(self) -> None:
        """Its worker ended: its posted save is its last, due at once."""
        for entry in self._own_posted():
            write_json_state(entry["json"], {**entry["doc"], "final": True})

    # ---- committing: one pusher of the node at a time, every GPU's newest in one commit ----
    def _commit_if_due(self, force: bool = False) -> None:
        """`force`: look now; else at most every DUE_CHECK_S (every look without a budget)."""
        if not force and self._gpu_every_s() > 0 and time.monotonic() < self.next_check:
            return
        self.next_check = time.monotonic() + DUE_CHECK_S
        if not self._due():
            return
        self.staging.mkdir(parents=True, exist_ok=True)
        with open(self.staging / RECOVERY_COMMIT_LOCK, "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return                   # another GPU's pusher is committing for the node
            if self._due():                     # still, under the lock
                self._commit()

    def _due(self) -> bool:
        return commit_due(self.staging, self._gpu_every_s())

    def _gpu_every_s(self) -> float:
        every = self.spec.get("gpu_commit_every_s")
        return gpu_commit_every_s(self.spec["hub_url"], 1) if every is None else float(every)

    def _commit(self) -> None:
        """Under the node's lock: no other commit of the node is in flight."""
        # links a committer killed mid-way left
        for stale in self.staging.glob(f"{RECOVERY_SENDING_PREFIX}*"):
            shutil.rmtree(stale, ignore_errors=True)
        entries = newest_per_gpu(posted(self.staging))
        sending = self.staging / f"{RECOVERY_SENDING_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        state = read_json_state(self.staging / RECOVERY_COMMIT_STATE)
        files, expected = {}, {}
        try:
            for entry in entries:
                path, doc = entry["hub_path"], entry["record"]
                files[path] = sending / f"{entry['name']}.pt"
                link_or_copy(entry["pt"], files[path])
                files[path + ".json"] = sending / f"{entry['name']}.json"
                files[path + ".json"].write_text(json.dumps(doc, sort_keys=True) + "\n")
                expected[path] = doc["sha256"]
            said = ", ".join(f"gpu{e['gpu']}@{e['record']['next_token']:,}" for e in entries)
            started = time.monotonic()
            revision = push_as_writer(
                open_store(self.spec["hub_url"], self.workdir), files,
                f"fractus-pod recovery copies: {said} (not yet probed)", expected,
                self.workdir / NODE_LEASE_DIR, self.spec["writer"])
        except RunTakenOver as exc:
            self._note(f"recovery pushes stopped: {exc}")
            for entry in posted(self.staging):
                remove_entry(entry)
            self.stopped = True
            return
        except IntegrityError as exc:     # a link holds other bytes than its event says
            self._note(f"recovery copies not pushed: {exc}")
            for entry in entries:
                remove_entry(entry)
            return
        except (HubError, OSError) as exc:
            failures = int(state.get("failures", 0)) + 1
            wait = min(RETRY_S[1], RETRY_S[0] * 2 ** (failures - 1))
            write_json_state(self.staging / RECOVERY_COMMIT_STATE,
                             {**state, "failures": failures, "retry_at": time.time() + wait})
            self._note(f"recovery push of {len(entries)} save(s) failed ({exc}); "
                       f"again in {wait:g}s")
            return
        finally:
            shutil.rmtree(sending, ignore_errors=True)
        write_json_state(self.staging / RECOVERY_COMMIT_STATE, {"at": time.time(), "failures": 0})
        for entry in posted(self.staging):      # what went up, and what it superseded
            if any(entry["gpu"] == e["gpu"] and entry["posted_at"] <= e["posted_at"]
                   for e in entries):
                remove_entry(entry)
        self._note(f"recovery copies pushed: {said} as {revision[:12]} in "
                   f"{time.monotonic() - started:.2f}s")

    def _note(self, text: str) -> None:
        print(f"[fractus-pod {time.strftime('%Y-%m-%d %H:%M:%S')}] {text}", flush=True)


def _check_main(spec: dict) -> int:
    try:
        check_save(Path(spec["path"]), int(spec["gpu"]), spec.get("run_id"),
                   spec.get("next_token"))
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 1
    except Exception as exc:     # a file that does not load: one line, not a traceback
        first = (str(exc).splitlines() or [""])[0][:300]
        print(f"{Path(spec['path']).name} does not load: {type(exc).__name__}: {first}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    if sys.argv[1] == CHECK_FLAG:
        sys.exit(_check_main(json.loads(sys.argv[2])))
    RecoveryPusher(json.loads(sys.argv[1])).run()
