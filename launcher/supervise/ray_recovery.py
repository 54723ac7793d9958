"""Recovery copies on a Ray pod: every save of a node's worker reaches the hub at once.

A checkpoint reaches the hub's normal location (`checkpoints/...`, what the manifest names)
only once its AR probe passed, and probes can trail the saves by many save intervals: a
node lost then cost everything trained since its newest passed push (18-32 save intervals
measured, issue 16 item 30). So beside that, each save of a node's worker that passes the
cheap checks (it loads weights-only, it says it is this GPU's, of this run, at the event's
token, and its weights are finite) is pushed at once, before any probe, to a separate hub
location, `recovery/<its path>` (with `recovery/<its path>.json`, the record below), as
the head's pod (the run's lease: nothing is committed once the run was taken over). The
passed copy stays where it is; a recovery copy is never in a manifest the hub holds.

The pusher is a process of its own on the node (`python -m launcher.supervise.ray_recovery
SPEC`), started by the GPU's actor with the worker and in a session of its own: it outlives
the actor, so the final save a worker writes on SIGTERM when its node is removed gracefully
(the actor dies first, issue 16 item 31(b)) is pushed too. It tails the worker's metrics
file, hard-links each checkpoint the moment its event is read (the worker's rotation cannot
take it away), pushes the newest one (a save arriving while a push is in flight replaces
the one waiting: at most one waits), and exits once the worker has ended and its final save
is pushed (or after FINAL_PUSH_S of failed attempts).

Bound: a GPU whose node is lost resumes from the newer of its newest passed hub copy and
its recovery copy (`read_recovery_copy`, launcher/supervise/ray_pushes.py). What it
retrains is what its worker trained after the newest save whose push had landed: at most
one save interval plus the saves made while one push was in flight.

The record names the worker's start (`attempt`, a new one at each start of a worker): the
launcher takes a recovery copy only from the start of the worker it lost, never one of an
earlier lineage (a rolled-back one, or a partitioned node's late push).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil

from launcher import child
from launcher.paths import RECOVERY_HUB_DIR, RECOVERY_STAGING_DIR
from launcher.worker.process import MetricsTail
from launcher.pod.ckpt_trust import read_identity
from launcher.pod.ckpt_index import link_or_copy
from launcher.pod.manifest import relative_to_pod
from launcher.hub import HubError, open_store
from launcher.hub.integrity import IntegrityError
from launcher.hub.lease import RunTakenOver, push_as_writer
from launcher.paths import NODE_LEASE_DIR
RECORD_FORMAT = "fractus-recovery/1"
TAIL_S = 0.2       # how often the pusher reads the metrics file: part of the recovery point
FINAL_PUSH_S = 600.0                      # after its worker ended: the final push's time
RETRY_S = (2.0, 30.0)                     # a failed push is tried again: first, longest wait
CHECK_FLAG = "--check"                    # `python -m ...ray_recovery --check SPEC`: check_save
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
    """The cheap checks of a save (no probe): ValueError, one line, when the file does not
    load weights-only, is another GPU's or run's, is at another token, or holds NaN/Inf."""
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
    """`check_save` in a process of its own, as a node actor must: loading torch's libraries
    holds the interpreter for seconds (over 5 s on a loaded machine), when the actor can hear
    no heartbeat and its fence, once it runs again, sees only silence (new actors fenced
    themselves before their workers started, again and again: the Ray test under load).
    ValueError, one line, as check_save. Started as every child is (launcher/child.py:
    scrubbed of the hub's token and other secrets, which a check needs none of)."""
    spec = {"path": str(path), "gpu": gpu, "run_id": run_id, "next_token": next_token}
    try:
        done = child.run(child.python_command("-m", "launcher.supervise.ray_recovery",
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
    plus `hub_revision` and `recovery: True`; None when the hub holds none of the worker
    start `attempt`. Reads the small record only, never the weights (the node that resumes
    pulls them, sha256-verified, and checks them again: `check_save`). HubError/OSError/
    ValueError when the hub cannot be read."""
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
    """The pusher of one worker start (`spec`: see RecoveryPusher), in a session of its own:
    neither a signal to the actor's group nor the actor's death ends it."""
    with open(log_path, "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "launcher.supervise.ray_recovery",
                                 json.dumps(spec)], cwd=workdir, env=_launcher_env(),
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _launcher_env() -> dict[str, str]:
    """This node's environment, with the launcher package's home on PYTHONPATH."""
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    return env


class RecoveryPusher:
    """`spec`: gpu, workdir, metrics (its worker's metrics file), offset (where its start's
    lines begin), pid and create_time (the worker), hub_url, writer (the head's pod id),
    attempt, run_id, node."""

    def __init__(self, spec: dict):
        self.spec = spec
        self.gpu = int(spec["gpu"])
        self.workdir = Path(spec["workdir"])
        self.tail = MetricsTail(self.workdir / spec["metrics"], offset=int(spec["offset"]))
        self.waiting: tuple[dict, Path] | None = None     # the newest save not pushed yet
        self.failures = 0
        self.stopped = False              # the run was taken over: nothing more goes up

    def run(self) -> None:
        importlib.import_module("torch")     # now: the first save waits for no import
        ended_at = None
        while not self.stopped and self.workdir.is_dir():   # a node directory removed: done
            alive = self._worker_alive()
            self._read()                # after the liveness check: the final save is read
            if self.waiting is not None:
                if not self._push_waiting() and not alive:
                    ended_at = ended_at or time.monotonic()
                    if time.monotonic() - ended_at > FINAL_PUSH_S:
                        self._note("gave up pushing the final save's recovery copy")
                        return
                continue
            if not alive:
                return
            time.sleep(TAIL_S)

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
            link = self.workdir / RECOVERY_STAGING_DIR / f"gpu{self.gpu}-{event['sha256'][:16]}.pt"
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
        """Push the waiting save; True when it is done with (pushed, or refused by the
        checks or its bytes); False after a failure (tried again after a wait)."""
        event, link = self.waiting
        token = int(event["next_token"])
        try:
            check_save(link, self.gpu, self.spec.get("run_id"), token)
        except ValueError as exc:
            self._note(f"save at token {token:,} not pushed as a recovery copy: {exc}")
            self._drop_waiting()
            return True
        doc = {"format": RECORD_FORMAT, "gpu": self.gpu, "sha256": event["sha256"],
               "next_token": token, "attempt": self.spec["attempt"], "node": self.spec["node"],
               "saved_at": event.get("ts"),
               **{k: event[k] for k in ("phase", "ema_tf", "lb", "step") if k in event}}
        record = link.with_suffix(".json")
        record.write_text(json.dumps(doc, sort_keys=True) + "\n")
        started = time.monotonic()
        try:
            store = open_store(self.spec["hub_url"], self.workdir)
            revision = push_as_writer(
                store, {recovery_path(event["path"]): link, record_path(event["path"]): record},
                f"fractus-pod recovery copy: gpu{self.gpu}@{token:,} (not yet probed)",
                {recovery_path(event["path"]): event["sha256"]},
                self.workdir / NODE_LEASE_DIR, self.spec["writer"])
        except RunTakenOver as exc:
            self._note(f"recovery pushes stopped: {exc}")
            self._drop_waiting()
            self.stopped = True
            return True
        except IntegrityError:
            self._drop_waiting()          # the link holds other bytes than its event says
            return True
        except (HubError, OSError) as exc:
            self.failures += 1
            wait = min(RETRY_S[1], RETRY_S[0] * 2 ** (self.failures - 1))
            self._note(f"recovery push of token {token:,} failed ({exc}); again in {wait:g}s")
            time.sleep(wait)
            return False
        finally:
            record.unlink(missing_ok=True)
        self.failures = 0
        self._note(f"recovery copy pushed: gpu{self.gpu}@{token:,} as {revision[:12]} in "
                   f"{time.monotonic() - started:.2f}s")
        self._drop_waiting()
        return True

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
