"""Which events are alerts, with what severity, and what one incident is (its dedupe key).
Fed every event in order: a hub push failing is an incident only after `hub_failures`
intervals in a row, and a lost node's GPU is followed to where it resumed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from launcher.config.alerts import SEVERITIES, AlertSettings


@dataclass(frozen=True)
class Alert:
    event: str                   # the event that caused it
    severity: str                # info | warning | critical
    key: str                     # one incident: the same key is said once
    title: str                   # one line a phone shows
    facts: dict = field(default_factory=dict)
    ts: float = 0.0              # the event's time


# The record's envelope, and the canary's per-step table (hundreds of rows: status has it).
_NOT_FACTS = ("ts", "event", "per_step")


def worst(alerts: list[Alert]) -> str:
    return max((a.severity for a in alerts), key=SEVERITIES.index)


def _tokens(value) -> str:
    return f"{value:,}" if isinstance(value, int) else str(value)


class AlertRules:
    def __init__(self, settings: AlertSettings):
        self.hub_failures = settings.hub_failures
        self.failed_pushes = 0               # interval pushes failed in a row
        self.hub_incident = 0                # counts recoveries: a new incident, a new key
        self.lost: dict[int, str] = {}       # GPU -> the node it was lost with
        self.table = {
            "pod_failed": self._pod_failed, "pod_stopped": self._pod_stopped,
            "pod_done": self._pod_done,
            "rollback": self._rollback, "gpu_given_up": self._given_up,
            "node_lost": self._node_lost, "worker_start": self._placed,
            "worker_placed": self._placed, "gpu_waiting": self._waiting,
            "sync_failed": self._push_failed, "sync_pushed": self._pushed,
            "hub_taken_over": self._taken_over, "hub_budget_refused": self._budget,
            "disk_low": self._disk_low, "canary": self._canary,
            "canary_skipped": self._canary_skipped, "gpu_outlier": self._outlier,
            "gpu_outlier_cleared": self._outlier_cleared, "merge_round": self._merge_round,
        }
        self.outlier_incident: dict[tuple, int] = {}    # (gpu, kind) -> times cleared

    def alert_for(self, record: dict) -> Alert | None:
        rule = self.table.get(record.get("event"))
        if rule is None:
            return None
        facts = {k: v for k, v in record.items() if k not in _NOT_FACTS}
        made = rule(facts)
        if made is None:
            return None
        severity, key, title = made
        return Alert(record["event"], severity, key, title, facts, record.get("ts", 0.0))

    # ---- one rule per event: (severity, dedupe key, title) or None --------------------
    def _pod_failed(self, f):
        return "critical", "pod_failed", f"pod FAILED at stage {f.get('stage')}: {f.get('reason')}"

    def _merge_round(self, f):
        """A refused round (an adopted one is the plan working: no alert)."""
        if f.get("verdict") != "refused":
            return None
        return ("warning", f"merge_round:{f.get('round')}",
                f"merge round {f.get('round')} refused, the GPUs train on with their own "
                f"weights: {str(f.get('reason'))[:200]}")

    def _pod_stopped(self, f):
        return "info", "pod_stopped", f"pod stopped at stage {f.get('stage')}: {f.get('reason')}"

    def _pod_done(self, f):
        return "info", "pod_done", f"pod done at stage {f.get('stage')}"

    def _rollback(self, f):
        gpu = f.get("gpu")
        return ("warning",
                f"rollback:gpu{gpu}:{f.get('from_stage')}->{f.get('to_stage')}:{f.get('to_token')}",
                f"GPU {gpu} rolled back: stage {f.get('from_stage')} -> {f.get('to_stage')}, "
                f"token {_tokens(f.get('from_token'))} -> {_tokens(f.get('to_token'))} "
                f"({f.get('reason')})")

    def _given_up(self, f):
        return ("critical", f"given_up:gpu{f.get('gpu')}",
                f"GPU {f.get('gpu')} given up: {f.get('reason')}")

    def _node_lost(self, f):
        gpu, node = f.get("gpu"), f.get("node")
        self.lost[gpu] = node
        return ("warning", f"node_lost:{node}:gpu{gpu}",
                f"node {node} lost: GPU {gpu} stopped at stage {f.get('stage')}")

    def _placed(self, f):
        gpu = f.get("gpu")
        if gpu not in self.lost:
            return None                      # an ordinary start
        node = self.lost.pop(gpu)
        where = f"node {f['node']}" if f.get("node") else "a new worker"
        return ("warning", f"node_lost:{node}:gpu{gpu}:resumed",
                f"GPU {gpu} (lost with node {node}) resumed on {where}"
                + (f" from token {_tokens(f['start_token'])}" if "start_token" in f else ""))

    def _waiting(self, f):
        gpu = f.get("gpu")
        node = self.lost.get(gpu)
        return ("warning", f"waiting:gpu{gpu}:{node}",
                f"GPU {gpu}" + (f" (lost with node {node})" if node else "")
                + f" waits: {f.get('reason')}")

    def _push_failed(self, f):
        if f.get("reason") in ("interval", "manifest"):
            self.failed_pushes += 1
            if self.failed_pushes < self.hub_failures:
                return None
            return ("warning", f"hub_failing:{self.hub_incident}",
                    f"hub push failing: {self.failed_pushes} intervals in a row "
                    f"({f.get('error')})")
        if str(f.get("retry", "")).startswith("none"):
            return ("warning", f"hub_failed:{f.get('reason')}:{f.get('gpu')}",
                    f"hub push ({f.get('reason')}) failed, not retried: {f.get('error')}")
        return None

    def _pushed(self, f):
        if self.failed_pushes >= self.hub_failures:
            self.hub_incident += 1           # recovered: a later failure is a new incident
        self.failed_pushes = 0
        return None

    def _taken_over(self, f):
        return ("critical", "hub_taken_over",
                f"hub push REFUSED: {f.get('error')}; pushes stop")

    def _budget(self, f):
        return ("critical", "hub_budget_refused",
                f"hub push REFUSED: budget reached ({f.get('error') or f.get('reason')})")

    def _disk_low(self, f):
        return ("warning", f"disk_low:{f.get('path')}",
                f"disk nearly full: {f.get('free_gib')} GiB free under {f.get('path')} "
                f"(alert below {f.get('threshold_gib')} GiB)")

    def _canary(self, f):
        switch = f"stage switch {f.get('from_stage')} -> {f.get('to_stage')}"
        if f.get("passed"):
            return "info", f"canary:{f.get('to_stage')}", f"{switch} passed the canary"
        return ("warning", f"canary:{f.get('to_stage')}",
                f"{switch} REFUSED by the canary: {f.get('reason')}")

    def _canary_skipped(self, f):
        return ("info", f"canary:{f.get('to_stage')}",
                f"stage switch {f.get('from_stage')} -> {f.get('to_stage')} without a "
                f"canary ({f.get('reason')})")

    def _outlier(self, f):
        """The peers check (launcher/checks/peers.py): value, median, threshold, window."""
        gpu, kind = f.get("gpu"), f.get("kind")
        numbers = (f"{f['value']:g} vs its peers' median {f.get('median'):g} (threshold "
                   f"{f.get('threshold'):g})" if isinstance(f.get("value"), (int, float))
                   else "")
        incident = self.outlier_incident.get((gpu, kind), 0)
        return ("warning", f"outlier:gpu{gpu}:{kind}:{incident}",
                f"GPU {gpu} off its peers ({kind})" + (f": {numbers}" if numbers else ""))

    def _outlier_cleared(self, f):
        key = (f.get("gpu"), f.get("kind"))
        self.outlier_incident[key] = self.outlier_incident.get(key, 0) + 1   # a new one next
        return None
