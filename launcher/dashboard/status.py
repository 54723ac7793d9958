"""`fractus-pod status`: the pod as its files describe it; it only reads them, with or
without a running launcher, and imports no HTTP client (which files: docs/LAUNCHER.md
"The pod directory").
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import psutil
from rich.console import Group
from rich.text import Text

from launcher.checks.canary import read_canary_state
from launcher.pod.ckpt_index import CheckpointIndex
from launcher.pod.events import read_events
from launcher.checks.health import PENDING, RUNNING
from launcher.pod.lock import read_holder
from launcher.pod.manifest import ManifestEntry, ManifestError, current_stage, read_manifest
from launcher.config.devices import parse_devices
from launcher.config.podconfig import PodConfig
from launcher.pod.live_state import read_pod_state
from launcher.dashboard.goodput import SESSION_ENDS, goodput_line
from launcher.dashboard.goodput_files import goodput_report
from launcher.dashboard.merge_status import rounds_report
from launcher.dashboard.status_checkpoints import (checkpoint_problem, hub_note, hub_tokens,
                                                  last_metrics, last_record,
                                                  node_checkpoint_age)
from launcher.dashboard.status_table import age as _age, fmt as _fmt, gpu_table, natural_width
from launcher.paths import metrics_path
from launcher.pod.shards import header_length
from launcher.config.stages import load_stages
from launcher.errors import UserError

WIDE_EVENT_CHARS = 400    # `status --wide`: an event line in full, up to this


def _shard_len(pod_dir: Path, rel: str) -> int | None:
    """From the shard's header: status never imports torch (None: no well-formed shard)."""
    return header_length(pod_dir / rel)


def _file_age(path: Path) -> float | None:
    """Seconds since `path` was written, the clock read after its stat (None: no file)."""
    try:
        written = path.stat().st_mtime
    except OSError:
        return None
    return time.time() - written


def _alive(pid) -> bool:
    try:
        return pid is not None and psutil.Process(int(pid)).status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, ValueError):
        return False


# The row of a GPU the manifest does not list (a new pod): no recorded field, not even a start.
NOT_LISTED = ManifestEntry(start_token=None)


def collect(pod_dir: Path, config: PodConfig, n_events: int = 8,
            goodput: dict | None = None) -> dict:
    """`goodput`: the ledger when the caller has it (else read from the files here)."""
    holder = read_holder(pod_dir)
    state = read_pod_state(pod_dir) if holder is not None else None
    last_state = state or read_pod_state(pod_dir) or {}
    try:
        manifest, manifest_error = read_manifest(pod_dir / config.manifest), None
    except ManifestError as exc:
        manifest, manifest_error = None, str(exc)
    entries = manifest.entries if manifest else {}
    try:   # the GPUs this pod runs; a manifest entry for another index is no GPU of it
        gpus = sorted({s.gpu for s in parse_devices(config.devices)})
    except Exception:
        gpus = sorted(entries)
    unrun = sorted(set(entries) - set(gpus))
    index = CheckpointIndex(pod_dir)
    held_on_hub = hub_tokens(pod_dir) if config.hub else None
    gpu_states = (state or {}).get("gpus", {})
    # A Ray pod: each checkpoint is on its node's disk, none on this one by design.
    on_nodes = bool(last_state.get("checkpoints_on_nodes")) or config.ray is not None
    last_gpu_states = last_state.get("gpus", {})     # verdicts survive the launcher
    last_stage = last_state.get("stage")               # ... and are of this stage
    rows = []
    for gpu in gpus:
        entry = entries.get(gpu)
        live = gpu_states.get(str(gpu), {})
        last = last_gpu_states.get(str(gpu), {})
        metrics = last_metrics(pod_dir / metrics_path(gpu)) or {}
        if state and metrics.get("ts", 0) < state.get("started_at", 0):
            metrics = {}          # a line from before this launch: not this run's numbers
        if live.get("state") == "waiting":
            metrics = {}          # its lost worker's: it resumes at the manifest's point
        phase = entry.at_phase if entry else 1
        try:
            shard = (entry and entry.shard) or config.shard_path(gpu, phase)
        except ValueError:        # a phase the config no longer lists (launch refuses it)
            shard = None
        length = _shard_len(pod_dir, shard) if shard else None
        # Running: the worker's newest line is the truth; stopped: the manifest is (the
        # final checkpoint comes after the last metrics line, a rollback before it).
        next_token = (metrics.get("next_token") if state and metrics else None)
        if next_token is None:
            next_token = entry.start_token if entry else metrics.get("next_token")
        entry = entry or NOT_LISTED
        # Each age against the clock read after its file: a save during this (slow on a
        # loaded pod) collection is age 0, never negative.
        if on_nodes:
            ckpt_age = node_checkpoint_age(pod_dir, gpu, entry, live)
        else:
            ckpt_age = _file_age(pod_dir / entry.checkpoint) if entry.checkpoint else None
        pid, node = live.get("pid"), live.get("node")
        verdict, reason = last.get("verdict"), last.get("reason")
        if state is None and verdict is not None and entry.stage is not None \
                and last_stage is not None and entry.stage != last_stage:
            # A rollback by hand since: the last run judged a stage this GPU has left.
            verdict, reason = None, (f"no check yet at stage {entry.stage} (the last run's "
                                     f"verdicts were of stage {last_stage})")
        elif state is None and verdict in (PENDING, RUNNING):
            # Nothing measures any more: the last run's checks stopped where it stopped.
            verdict, reason = "Incomplete", f"the last run stopped at {reason}"
        rows.append({
            "gpu": gpu,
            "pid": pid,
            "node": node,
            # A pid on another machine (a Ray node) cannot be checked from here.
            "alive": _alive(pid) if node is None else live.get("state") == "running",
            "state": live.get("state", "not running"),
            "stage": entry.stage,
            # The data phase and its shard: shard_pct is the share of this phase done.
            "phase": phase,
            "phases": len(config.phases),
            "phase_name": config.phases[phase - 1].name if phase <= len(config.phases)
            else None,
            "next_token": next_token,
            "start_token": entry.start_token,
            "shard_tokens": length,
            "shard_pct": (100.0 * next_token / length) if length and next_token is not None
            else None,
            "ema_tf": metrics.get("ema_tf", entry.ema_tf),
            "ema_ss": metrics.get("ema_ss"),
            "lb": metrics.get("lb", entry.lb),
            "tok_s": metrics.get("tok_s"),
            "mem_gb": metrics.get("mem_gb"),
            "metrics_age_s": time.time() - metrics["ts"] if metrics.get("ts") else None,
            "checkpoint": entry.checkpoint,
            "checkpoint_age_s": ckpt_age,
            "checkpoint_problem": None if on_nodes
            else checkpoint_problem(pod_dir, gpu, entry, index),
            "hub_revision": entry.hub_revision,
            "hub_note": hub_note(entry, held_on_hub, gpu),
            "verdict": verdict,
            "reason": reason,
            "restarts": last.get("restarts", 0),
            "last_error": last.get("last_error"),
            "verdict_from_last_run": state is None and bool(last) and verdict is not None,
            "peers": live.get("peers") or {},     # off its peers now (a running pod only)
            **_compile_note(pod_dir, gpu, state),
        })
    pod_state = (state or {}).get("pod_state") if holder is not None else None
    reason = last_state.get("reason")
    events = read_events(pod_dir)
    if pod_state is None:
        pod_state = {"failed": "FAILED"}.get(last_state.get("pod_state"), "not running")
        ended = _recorded_end(events, last_state)
        if ended is not None:       # the launcher ended after its last view of the pod
            pod_state = "FAILED" if ended["event"] == "pod_failed" else pod_state
            reason = ended.get("reason") or reason
    return {
        "pod_dir": str(pod_dir),
        "launcher_pid": (holder or {}).get("pid") if holder is not None else None,
        "pod_state": pod_state.upper() if pod_state != "not running" else pod_state,
        "stage": current_stage(state, manifest),
        "stage_name": (last_state.get("stage_name") if state else None)
        or _stage_name(pod_dir, config, current_stage(state, manifest)),
        "reason": reason,
        "uptime_s": time.time() - state["started_at"] if state and state.get("started_at") else None,
        "manifest_error": manifest_error,
        "manifest_unrun_gpus": unrun,
        "devices": config.devices,
        "gpus": rows,
        "events": events[max(0, len(events) - n_events):],
        "sync": _sync_report(pod_dir, config),
        "canary": _canary_report(pod_dir),
        "goodput": goodput if goodput is not None else goodput_report(pod_dir, config),
        "merge_rounds": rounds_report(pod_dir, config, current_stage(state, manifest), gpus, state),
    }


def _compile_note(pod_dir: Path, gpu: int, state: dict | None) -> dict:
    """From this launch's newest `compile` event: `recompiles`, and `compile_fallback`
    (diverged or failed: it went on uncompiled); both None without such an event."""
    note = {"recompiles": None, "compile_fallback": None}
    if not state:
        return note
    record = last_record(pod_dir / metrics_path(gpu), lambda r: r.get("event") == "compile")
    if record is None or record.get("ts", 0) < state.get("started_at", 0):
        return note
    fallback = record.get("status") in ("diverged", "failed")
    return {"recompiles": None if fallback else record.get("recompiles"),
            "compile_fallback": record.get("status") if fallback else None}


def _recorded_end(events: list[dict], last_state: dict) -> dict | None:
    """The last launch's end event when pod_state.json does not show it (a launcher whose
    pod files went away records its end in the events only); else None."""
    if last_state.get("pod_state") in ("stopped", "done", "failed"):
        return None                 # the view was written at the end: it says it all
    started = last_state.get("started_at") or 0
    for event in reversed(events):
        if event.get("event") == "launch":
            return None             # a launch after the last end: no end recorded yet
        if event.get("event") in SESSION_ENDS:
            ts = event.get("ts")
            return event if isinstance(ts, (int, float)) and ts >= started else None
    return None


def _stage_name(pod_dir: Path, config, stage: int | None) -> str | None:
    """`stage`'s name (None also when stages.yaml does not parse: status shows the rest)."""
    if stage is None:
        return None
    try:
        found = load_stages(pod_dir / config.stages).get(stage)
    except UserError:
        return None
    return found.name if found else None


def _canary_report(pod_dir: Path) -> dict | None:
    """The last canary without its per-step rows (those stay in logs/events.jsonl)."""
    record = read_canary_state(pod_dir)
    if record is None:
        return None
    return {k: record.get(k) for k in ("ts", "status", "passed", "from_stage", "to_stage",
                                       "gpu", "device", "exact", "reason", "seconds")}


def _sync_report(pod_dir: Path, config: PodConfig) -> dict | None:
    """The hub sync as the launcher (or `sync push`) last recorded it; errors re-scrubbed."""
    # launcher.hub (its package, ~45 ms) only where a pod has a hub: `status` stays fast
    from launcher.hub.hub_rate import rate_report
    from launcher.hub.redact import scrub
    from launcher.hub.retention import STATE_KEYS as STORAGE_KEYS
    from launcher.hub.sync_state import read_sync_state
    if not config.hub:
        return None
    state = read_sync_state(pod_dir)
    now = time.time()          # after the read: an age is never negative
    error = state.get("last_error")

    def age(key):
        return now - state[key] if isinstance(state.get(key), (int, float)) else None
    return {"hub": config.hub,
            "interval_s": config.sync_settings().interval_s,
            "last_revision": state.get("last_revision"),
            "last_success_at": state.get("last_success_at"),
            "last_success_age_s": age("last_success_at"),
            "last_pushed_tokens": state.get("last_pushed_tokens"),
            "in_flight": bool(state.get("in_flight")),
            "last_result": state.get("last_result"),
            "last_error": scrub(error) if error else None,
            "last_error_at": state.get("last_error_at"),
            "last_error_age_s": age("last_error_at"),
            "taken_over": state.get("taken_over"),
            # the hub's rate limiting and commits an hour (launcher/hub/hub_rate.py)
            "rate": rate_report(pod_dir, now, config.hub),
            "commits_per_hour": config.sync_settings().commits_per_hour,
            # retention (launcher/hub/retention.py): recorded after each push under a policy
            "storage": {k: state.get(k) for k in STORAGE_KEYS}
            if state.get("hub_bytes_kept") is not None else None}


def _held(tokens: dict | None) -> str:
    """How far the last push goes per GPU (an unverified row shows no hub rev)."""
    if not tokens:
        return ""
    return ", holding " + " ".join(f"gpu{g}@{int(t):,}" for g, t in
                                   sorted(tokens.items(), key=lambda kv: int(kv[0])))


def _rounded(value):
    """An event's floats as people read them (AR 1078.0662, not 1078.066162109375)."""
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


class StatusView:
    """Laid out at render time: `status --watch` follows a resized terminal."""

    def __init__(self, report: dict, wide: bool = False):
        self.report, self.wide = report, wide

    def natural_width(self) -> int:
        return natural_width(self.report["gpus"])

    def __rich_console__(self, console, options):
        yield render_status(self.report, None if self.wide else options.max_width)


def render_status(report: dict, width: int | None = None):
    """Header, GPU table and events fitted to `width` (None: every column in full)."""
    head = (f"pod {report['pod_dir']}: {report['pod_state']}"
            f"  stage {_fmt(report['stage'])}"
            + (f" ({report['stage_name']})" if report.get("stage_name") else "")
            + (f"  uptime {_age(report['uptime_s'])}" if report.get("uptime_s") else "")
            + (f"  launcher pid {report['launcher_pid']}" if report.get("launcher_pid") else ""))
    parts = [Text(head, style="bold")]
    if (report.get("sync") or {}).get("taken_over"):      # first, where a person looks
        parts.append(Text(f"HUB TAKEN OVER: {report['sync']['taken_over']}", style="bold red"))
    if report.get("reason"):
        parts.append(Text(f"reason: {report['reason']}"))
    if report.get("manifest_error"):
        parts.append(Text(f"manifest: {report['manifest_error']}", style="red"))
    if report.get("manifest_unrun_gpus"):
        names = ", ".join(f"gpu_{g}" for g in report["manifest_unrun_gpus"])
        parts.append(Text(f"manifest also lists {names}, which this pod's devices "
                          f"({report['devices']}) do not run: kept, not shown", style="yellow"))
    parts.append(gpu_table(report["gpus"], width))
    for r in report["gpus"]:
        if r.get("last_error"):
            parts.append(Text(f"GPU {r['gpu']} last error: {r['last_error']}", style="red"))
        if r.get("checkpoint_problem"):
            parts.append(Text(f"GPU {r['gpu']} checkpoint: {r['checkpoint_problem']}",
                              style="red"))
        if r.get("hub_note"):
            parts.append(Text(f"GPU {r['gpu']} hub: {r['hub_note']}", style="yellow"))
        for mark in (r.get("peers") or {}).values():
            parts.append(Text(f"GPU {r['gpu']} off its peers: {mark}", style="yellow"))
    sync = report.get("sync")
    if sync:
        line = (f"hub {sync['hub']} (every {_age(sync['interval_s'])}): last push "
                + (f"{sync['last_revision'][:12]} at "
                   f"{time.strftime('%H:%M:%S', time.localtime(sync['last_success_at'] or 0))} "
                   f"({_age(sync['last_success_age_s'])} ago)"
                   if sync.get("last_revision") else "none yet")
                + _held(sync.get("last_pushed_tokens"))
                + (" ; pushing now" if sync.get("in_flight") else ""))
        parts.append(Text(line))
        if sync.get("rate"):
            from launcher.hub.hub_rate import rate_line     # as in _sync_report
            parts.append(Text(rate_line(sync["rate"], sync.get("commits_per_hour")),
                              style="red" if sync["rate"].get("limited") else None))
        if sync.get("storage"):
            from launcher.hub.retention import storage_line     # as in _sync_report
            parts.append(Text(storage_line(sync["storage"])))
        if sync.get("last_error") and not sync.get("taken_over"):   # (that one is on top)
            parts.append(Text(f"hub last error ({_age(sync['last_error_age_s'])} ago"
                              + (", since succeeded" if sync.get("last_result") == "ok" else "")
                              + f"): {sync['last_error']}",
                              style="yellow" if sync.get("last_result") == "ok" else "red"))
    if report.get("goodput"):
        parts.append(Text(goodput_line(report["goodput"])))
    rounds = report.get("merge_rounds")
    if rounds:
        refused = (rounds.get("last") or {}).get("state") == "refused"
        parts.append(Text(rounds["line"], style="red" if rounds.get("error")
                          else "yellow" if refused else None))
    canary = report.get("canary")
    if canary:
        when = time.strftime("%H:%M:%S", time.localtime(canary.get("ts") or 0))
        style = {"Successful": "green", "Failed": "red", "Inconclusive": "yellow"}.get(
            canary.get("status"), None)
        parts.append(Text(f"last canary ({when}, stage {_fmt(canary.get('from_stage'))} -> "
                          f"{_fmt(canary.get('to_stage'))}, GPU {_fmt(canary.get('gpu'))}): "
                          f"{canary.get('status')}: {canary.get('reason')}", style=style))
    if report["events"]:
        parts.append(Text("recent events:", style="bold"))
        for e in report["events"]:
            when = time.strftime("%H:%M:%S", time.localtime(e.get("ts", 0)))
            rest = {k: v for k, v in e.items() if k not in ("ts", "event")}
            line = f"  {when} {e.get('event')} {json.dumps(_rounded(rest), default=str)}"
            if width is None and len(line) > WIDE_EVENT_CHARS:   # a canary's per-step rows
                line = line[:WIDE_EVENT_CHARS - 1] + "…"
            # Cut to the line with an ellipsis: a cut JSON object must look cut.
            parts.append(Text(line, no_wrap=width is not None, overflow="ellipsis"))
    return Group(*parts)
