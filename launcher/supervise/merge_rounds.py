"""Merge rounds (docs/LAUNCHER.md, "Merge rounds"): owner of merge/ in the pod dir (the ledger,
the workers' inbox, the round files, the outer state). Invariant: a round's verdict is
written to the ledger (its commit point) before anything acts on it (the outer state's
commit, the inbox the workers read); a round without a verdict never reached a GPU, and a
relaunch forgets it and runs it again from the same checkpoints (outer_step is a pure
function: the same bytes). A refused round changes no GPU's weights and no outer state.

A round, driven from the supervisor's loop (`tick`): each worker reaching its round boundary
saves and says `merge_wait` (its checkpoint and sha256), then waits on the inbox. Once the
quorum waits and every other GPU that could still come has come, or `grace_s` has passed,
the round runs in a background thread (the loop keeps tending the others): outer_step
(commit=False), then the gate (launcher/checks/merge_gate.py); its verdict goes to the
ledger, then the outer state is committed (or the candidate deleted), then the inbox names
the round, its file and its quorum ({gpu: next token}): the quorum's workers adopt in
place, the others train on with their own weights.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from launcher.checks.merge_gate import MergeGate, judge, measure_gpu
from launcher.checks.probe_check import ProbeTolerance
from launcher.config.merge_rounds_settings import MergeRoundSettings
from launcher.files import sha256_file, write_json_state
from launcher.hub.outer_step import commit_outer_state, outer_step, read_outer_state
from launcher.paths import (MERGE_INBOX_FILE, OUTER_STATE_FILE, OUTER_STATE_PENDING,
                            ROUNDS_LEDGER, merged_round_path)
from launcher.pod.events import EventLog
from launcher.pod.rounds_ledger import fresh_ledger, read_ledger
from launcher.supervise.gpu_run import GpuRun
from launcher.supervise.state import GpuState

# Tests only: SIGKILL the launcher at a round's point ("started", "merged", "decided").
FAULT_ENV = "FRACTUS_POD_ROUND_FAULT"
FAULT_POINTS = ("started", "merged", "decided")
# GPUs that may still reach a boundary: running, restarting, or waiting to be placed.
COMING = (GpuState.PENDING, GpuState.RUNNING, GpuState.BACKOFF, GpuState.WAITING)


@dataclass(frozen=True)
class Arrival:
    """A worker waiting at round boundary `boundary`, its checkpoint there."""
    gpu: int
    boundary: int
    at_token: int
    checkpoint: str        # relative to the pod dir
    sha256: str
    since: float           # the launcher's clock when it said so


@dataclass(frozen=True)
class Outcome:
    adopted: bool
    reason: str
    gate: dict | None
    merged_sha256: str | None


class MergeRounds:
    """`runs`, `stage`, `baseline`, `shard`: the pod's as they stand now (they change);
    `baseline(gpu)`: the AR baseline of that GPU's shard at this stage, or None; `shard(gpu)`:
    the shard it trains on; `pushed(reason)`: the hub sync pushes the round; `seq`: the
    stage's SEQ, the gate's chunk."""

    def __init__(self, settings: MergeRoundSettings, pod_dir: Path,
                 events: EventLog, gate: MergeGate, tolerance: ProbeTolerance, clock,
                 runs: Callable[[], dict[int, GpuRun]], stage: Callable[[], int],
                 baseline: Callable[[int], object], pushed: Callable[[str], None],
                 shard: Callable[[int], str], seq: int):
        self.settings, self.pod_dir, self.events = settings, pod_dir, events
        self.gate, self.tolerance, self.clock = gate, tolerance, clock
        self.runs, self.stage, self.baseline, self.pushed, self.shard, self.seq = \
            runs, stage, baseline, pushed, shard, seq
        self.ledger = read_ledger(pod_dir) or fresh_ledger()   # checked at launch
        self.waiting: dict[int, Arrival] = {}
        self.quorum_at: float | None = None       # when the open boundary reached its quorum
        self.future: Future | None = None
        self.executor: ThreadPoolExecutor | None = None
        self.fault = os.environ.get(FAULT_ENV)

    # ---- at launch ----------------------------------------------------------------------
    def begin(self, start_tokens: dict[int, int]) -> None:
        """Forget an undecided round, finish acting on a decided one, fix this stage's
        origins (each GPU's first start token with rounds on)."""
        rounds = self.ledger["rounds"]
        if rounds and rounds[-1]["state"] == "merging":
            forgotten = rounds.pop()
            for name in (merged_round_path(forgotten["round"]), OUTER_STATE_PENDING):
                (self.pod_dir / name).unlink(missing_ok=True)
            self.events.emit("merge_round_forgotten", round=forgotten["round"],
                             reason="no verdict before the last launcher ended: run again")
        if rounds:
            self._act(rounds[-1])
        origins = self.ledger["origins"].setdefault(str(self.stage()), {})
        for gpu, token in start_tokens.items():
            origins.setdefault(str(gpu), int(token))
        self._save()

    def worker_env(self, gpu: int, start_token: int | None) -> dict[str, str]:
        """What a worker of `gpu` starting at `start_token` needs to take part (MERGE_*);
        its first start at a stage (a rollback's too) fixes its origin there."""
        origins = self.ledger["origins"].setdefault(str(self.stage()), {})
        if str(gpu) not in origins:
            origins[str(gpu)] = int(start_token or 0)
            self._save()
        origin = origins[str(gpu)]
        return {"MERGE_INBOX": MERGE_INBOX_FILE,
                "MERGE_EVERY": str(self.settings.every_tokens or 0),
                "MERGE_ORIGIN": str(origin)}

    # ---- the workers' events ------------------------------------------------------------
    def on_wait(self, run: GpuRun, record: dict) -> None:
        boundary, token, path, digest = (record.get(k) for k in
                                         ("boundary", "next_token", "checkpoint", "sha256"))
        if not (isinstance(boundary, int) and isinstance(token, int) and isinstance(path, str)
                and isinstance(digest, str)):
            return
        run.said_merge_wait(self.clock())
        rel = os.path.relpath(Path(path) if Path(path).is_absolute() else self.pod_dir / path,
                              self.pod_dir)
        self.waiting[run.slot.gpu] = Arrival(run.slot.gpu, boundary, token, rel, digest,
                                             self.clock())

    def on_resumed(self, run: GpuRun, record: dict) -> None:
        """merge_adopted / merge_skipped: the worker trains again."""
        run.said_merge_resumed(self.clock())

    # ---- each turn of the supervisor's loop ---------------------------------------------
    def tick(self) -> None:
        if self.future is not None:
            if self.future.done():
                self._decide(self.future.result())
            return
        runs = self.runs()
        for gpu in [g for g in self.waiting if runs[g].proc is None]:
            del self.waiting[gpu]          # its worker ended: it says so again at its start
        if not self.waiting:
            self.quorum_at = None
            return
        boundary = min(a.boundary for a in self.waiting.values())
        arrived = {g: a for g, a in self.waiting.items() if a.boundary == boundary}
        coming = {g for g, r in runs.items() if r.state in COMING and g not in arrived}
        need = self.settings.quorum_of(len(runs))
        if len(arrived) + len(coming) < need:
            self._open(boundary, arrived, refuse=f"quorum {need} cannot be reached: "
                       f"{len(arrived)} GPU(s) waiting, {len(coming)} more running")
            return
        if len(arrived) < need:
            return
        if coming:
            if self.quorum_at is None:
                self.quorum_at = self.clock()
            if self.clock() - self.quorum_at < self.settings.grace_s:
                return
        self._open(boundary, arrived)

    def stage_end_pending(self, ends: dict[int, tuple[str, str, int]]) -> bool:
        """`at_stage_end`, at a launch's clean end (`ends`: each finished GPU's final
        (checkpoint, sha256, next token)): True while its round runs (the pod waits for its
        verdict); False once decided (these very checkpoints), or with no such round. The
        GPUs take its weights at their next start (the inbox names each at its token)."""
        if not self.settings.at_stage_end:
            return False
        if self.future is not None:
            return True
        last = self.ledger["rounds"][-1] if self.ledger["rounds"] else None
        at_tokens = {str(g): token for g, (_, _, token) in ends.items()}
        if last is not None and last["boundary"] is None and last["stage"] == self.stage() \
                and {g: r["at_token"] for g, r in last["gpus"].items()} == at_tokens:
            return False
        now = self.clock()
        arrived = {g: Arrival(g, 0, token, checkpoint, digest, now)
                   for g, (checkpoint, digest, token) in ends.items()}
        need = self.settings.quorum_of(len(self.runs()))
        self._open(None, arrived, refuse=None if len(arrived) >= need else
                   f"quorum {need} cannot be reached: {len(arrived)} GPU(s) ended the stage "
                   f"cleanly")
        return self.future is not None

    def close(self) -> None:
        """The pod ends: a round in flight is abandoned (no verdict: the next launch runs it
        again)."""
        if self.executor is not None:
            self.executor.shutdown(wait=False, cancel_futures=True)

    # ---- a round ------------------------------------------------------------------------
    def _open(self, boundary: int | None, arrived: dict[int, Arrival], refuse: str | None = None) -> None:
        rounds = self.ledger["rounds"]
        n = len(rounds) + 1
        gpus = sorted(arrived)
        tokens = {g: arrived[g].at_token - self._last_token(g) for g in gpus}
        entry = {"round": n, "stage": self.stage(), "boundary": boundary, "state": "merging",
                 "gpus": {str(g): {"at_token": arrived[g].at_token,
                                   "checkpoint": arrived[g].checkpoint,
                                   "sha256": arrived[g].sha256, "tokens": tokens[g]}
                          for g in gpus},
                 "left_out": sorted(set(self.runs()) - set(gpus)),
                 "weights": [float(tokens[g]) if self.settings.weights == "tokens" else 1.0
                             for g in gpus],
                 "outer": self.settings.outer.to_dict(), "merged": None,
                 "merged_sha256": None, "gate": None, "reason": "", "seconds": None,
                 "opened_at": min(a.since for a in arrived.values()) if arrived else None}
        rounds.append(entry)
        self._save()
        self.quorum_at = None
        if refuse is not None:
            self._decide(Outcome(False, refuse, None, None))
            return
        self._inject("started")
        self.executor = self.executor or ThreadPoolExecutor(1, thread_name_prefix="merge-round")
        self.future = self.executor.submit(self._run, entry, self._last_adopted())

    def _run(self, entry: dict, last_adopted: int) -> Outcome:
        """The round's slow part, on the round's thread: merge, then gate. Errors as values."""
        gpus = sorted(int(g) for g in entry["gpus"])
        records = entry["gpus"]

        def verify(source: Path, path: Path) -> None:
            digest = records[str(gpus[sources.index(source)])]["sha256"]
            if sha256_file(path) != digest:
                raise ValueError(f"{path} changed since its worker saved it for the round")

        sources = [self.pod_dir / records[str(g)]["checkpoint"] for g in gpus]
        weights = entry["weights"] if self.settings.weights == "tokens" else None
        try:
            report = outer_step(self.pod_dir, entry["round"], sources, self.settings.outer,
                                weights, verify=verify, commit=False, last_adopted=last_adopted)
        except (ValueError, OSError) as exc:
            return Outcome(False, f"merge failed: {str(exc).splitlines()[0][:300]}", None, None)
        self._inject("merged")
        merged = merged_round_path(entry["round"])
        runs = self.runs()

        def measure(i: int, g: int) -> dict:
            # On its own GPU (paused at the boundary, its memory held), all at once: the
            # gate costs one GPU's measurement, not the sum.
            return measure_gpu(self.pod_dir, records[str(g)]["checkpoint"], merged,
                               self.shard(g), records[str(g)]["at_token"], self.gate, self.seq,
                               probe=bool(self.gate.probe) and i == 0,
                               device=runs[g].slot.device, gpu=g)
        try:
            with ThreadPoolExecutor(len(gpus), thread_name_prefix="merge-gate") as pool:
                futures = {g: pool.submit(measure, i, g) for i, g in enumerate(gpus)}
                measured = {g: f.result() for g, f in futures.items()}
        except (RuntimeError, OSError) as exc:
            return Outcome(False, f"gate could not run: {exc}", None, report.sha256)
        passed, reason, gate = judge(measured, self.gate, self.baseline(gpus[0]),
                                     self.tolerance)
        return Outcome(passed, reason, gate, report.sha256)

    def _decide(self, outcome: Outcome) -> None:
        """The verdict into the ledger (the commit point), then act on it, then say it."""
        self.future = None
        entry = self.ledger["rounds"][-1]
        entry.update(state="adopted" if outcome.adopted else "refused", reason=outcome.reason,
                     gate=outcome.gate, merged_sha256=outcome.merged_sha256 if outcome.adopted
                     else None, merged=merged_round_path(entry["round"]) if outcome.adopted
                     else None,
                     seconds=round(max(0.0, self.clock() - entry["opened_at"]), 3)
                     if entry.get("opened_at") is not None else None)
        self._save()
        self._inject("decided")
        self._act(entry)
        for gpu in list(self.waiting):
            if entry["boundary"] is not None and self.waiting[gpu].boundary <= entry["boundary"]:
                del self.waiting[gpu]
        verdict = entry["state"]
        self.events.emit("merge_round", round=entry["round"], stage=entry["stage"],
                         boundary=entry["boundary"], verdict=verdict,
                         quorum=sorted(int(g) for g in entry["gpus"]),
                         left_out=entry["left_out"],
                         at_tokens={g: r["at_token"] for g, r in entry["gpus"].items()},
                         gate=entry["gate"], reason=entry["reason"], seconds=entry["seconds"],
                         outer=entry["outer"]["step"], merged_sha256=entry["merged_sha256"])
        self.pushed(f"merge round {entry['round']} {verdict}")

    def _act(self, entry: dict) -> None:
        """What a decided round does, idempotent (a relaunch completes it): the outer state
        committed or the candidate dropped, older round files removed, the inbox written."""
        n, pod = entry["round"], self.pod_dir
        pending = pod / OUTER_STATE_PENDING
        if entry["state"] == "adopted":
            if pending.exists():
                commit_outer_state(pod, n)
            inbox = {"round": n, "stage": entry["stage"], "boundary": entry["boundary"],
                     "path": entry["merged"],
                     "sha256": entry["merged_sha256"],
                     "gpus": {g: r["at_token"] for g, r in entry["gpus"].items()}}
            for old in pod.glob("merge/round_*.pt"):
                if old.name != Path(entry["merged"]).name:
                    old.unlink(missing_ok=True)
        else:
            pending.unlink(missing_ok=True)
            (pod / merged_round_path(n)).unlink(missing_ok=True)
            inbox = {"round": n, "stage": entry["stage"], "boundary": entry["boundary"],
                     "refused": True, "gpus": {}}
        write_json_state(pod / MERGE_INBOX_FILE, inbox)

    # ---- helpers ------------------------------------------------------------------------
    def _last_adopted(self) -> int:
        adopted = [e["round"] for e in self.ledger["rounds"] if e["state"] == "adopted"]
        if adopted and (self.pod_dir / OUTER_STATE_FILE).exists():
            read_outer_state(self.pod_dir / OUTER_STATE_FILE, expect_round=adopted[-1])
        return adopted[-1] if adopted else 0

    def _last_token(self, gpu: int) -> int:
        """Where `gpu` last took part in a round of this stage, else its origin."""
        stage = self.stage()
        for entry in reversed(self.ledger["rounds"]):
            record = entry["gpus"].get(str(gpu))
            if entry["stage"] == stage and record is not None and entry["state"] != "merging":
                return record["at_token"]
        return int(self.ledger["origins"].get(str(stage), {}).get(str(gpu), 0))

    def _save(self) -> None:
        write_json_state(self.pod_dir / ROUNDS_LEDGER, self.ledger, indent=1)

    def _inject(self, point: str) -> None:
        if self.fault == point:
            os.kill(os.getpid(), signal.SIGKILL)
