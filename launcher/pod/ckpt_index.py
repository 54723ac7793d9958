"""Checkpoint verdicts (logs/checkpoints.jsonl) and a retained copy of each checkpoint.
Owner: the checkpoint custodian (launcher/supervise/custodian.py) while a launcher runs;
the launch's preparation before it. Appended lines only; the newest per (gpu, sha256) wins.
Verdicts and retention: docs/LAUNCHER.md, Checkpoint verdicts.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import time
from pathlib import Path

from launcher.paths import INDEX_FILE, PASSED_DIR
from launcher.files import sha256_file
from launcher.pod.manifest import resolve_in_pod

KEEP_PASSED = 2
VERIFY_BELOW_BYTES = 256 << 20
PENDING, PASSED, FAILED = "pending", "passed", "failed"


def rotated_names(source: Path) -> list[Path]:
    """The worker's rotated copies of `source` (name.1, name.2, ...), oldest bytes last."""
    rotated = []
    for path in source.parent.glob(f"{glob.escape(source.name)}.*"):
        suffix = path.name[len(source.name) + 1:]
        if suffix.isdigit():
            rotated.append((int(suffix), path))
    return [path for _k, path in sorted(rotated)]


def link_or_copy(source: Path, target: Path) -> None:
    """Atomically make `target` a hard link to `source` (bytes pinned), else a copy."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(source, tmp)
    except OSError:        # no hard links here: fall back to a copy
        shutil.copyfile(source, tmp)
    os.replace(tmp, target)


class CheckpointIndex:
    def __init__(self, pod_dir: Path):
        self.pod_dir = pod_dir
        self.path = pod_dir / INDEX_FILE
        self.records: dict[tuple[int, str], dict] = {}
        self.size = 0           # lines appended by this process: a cheap change counter
        # logs/ vanishing under a running launcher is a pod error, never made anew.
        self._make_logs = not self.path.parent.is_dir()
        if self.path.is_file():
            for line in self.path.read_text().splitlines():
                try:
                    r = json.loads(line)
                    self.records[(int(r["gpu"]), r["sha256"])] = r
                except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                    continue

    def _append(self, record: dict) -> dict:
        if self._make_logs:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._make_logs = False
        record = {**record, "ts": time.time()}
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(record) + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        self.records[(int(record["gpu"]), record["sha256"])] = record
        self.size += 1
        return record

    def add(self, gpu: int, event: dict, stage: int, path: str,
            verdict: str = PENDING, reason: str = "") -> dict:
        """Record a checkpoint event (path relative to the pod directory) and retain it."""
        existing = self.records.get((gpu, event["sha256"]))
        if existing is not None:
            return existing
        record = {
            "gpu": gpu, "sha256": event["sha256"], "path": path,
            "next_token": int(event["next_token"]), "step": event.get("step"),
            "ema_tf": event.get("ema_tf"), "lb": event.get("lb"), "stage": stage,
            "verdict": verdict, "reason": reason}
        if event.get("phase", 1) != 1:     # a later data phase (none recorded: phase 1)
            record["phase"] = int(event["phase"])
        record["retained"] = self._retain(record, event.get("bytes"), event.get("mtime_ns"))
        return self._append(record)

    def mark(self, gpu: int, sha256: str, verdict: str, reason: str) -> dict:
        record = dict(self.records[(gpu, sha256)])
        record.update(verdict=verdict, reason=reason)
        if verdict == FAILED and record.get("retained"):
            (self.pod_dir / record["retained"]).unlink(missing_ok=True)
            record["retained"] = None
        record = self._append(record)
        if verdict == PASSED:
            self._prune(gpu)
        return record

    def for_gpu(self, gpu: int) -> list[dict]:
        """This GPU's checkpoints, oldest first: by data phase, then token."""
        rows = [r for (g, _), r in self.records.items() if g == gpu]
        return sorted(rows, key=lambda r: (r.get("phase") or 1, r["next_token"], r.get("ts", 0)))

    def pending(self, gpu: int) -> list[dict]:
        return [r for r in self.for_gpu(gpu) if r["verdict"] == PENDING]

    def newest_passed(self, gpu: int, verify: bool = True) -> dict | None:
        """The newest passed checkpoint whose file still holds the recorded bytes.
        verify=False hashes nothing and trusts only retained links (their bytes are pinned;
        the worker's own name may hold newer bytes by now)."""
        for record in reversed(self.for_gpu(gpu)):
            if record["verdict"] != PASSED:
                continue
            names = (record.get("retained"), record["path"]) if verify else \
                (record.get("retained"),)
            for rel in names:
                if not rel:
                    continue
                try:
                    candidate = resolve_in_pod(rel, self.pod_dir)
                except ValueError:
                    continue
                if candidate.is_file() and (not verify
                                            or sha256_file(candidate) == record["sha256"]):
                    return {**record, "path": rel}
        return None

    def file_sha256(self, gpu: int, path: Path, recorded_sha256: str) -> str:
        """The sha256 at `path`: `recorded_sha256` without hashing when it is the same inode
        as that checkpoint's retained link (files are replaced by rename, never written in
        place); else hashed."""
        record = self.records.get((gpu, recorded_sha256)) or {}
        retained = self.pod_dir / record["retained"] if record.get("retained") else None
        try:
            if retained is not None and os.path.samefile(path, retained):
                return recorded_sha256
        except OSError:
            pass
        return sha256_file(path)

    def _retain(self, record: dict, size: int | None, mtime_ns: int | None = None) -> str | None:
        """Hard-link the checkpoint under checkpoints/retained/gpu{i}/ now, before rotation.

        Checked by sha256 below VERIFY_BELOW_BYTES, else by size and the worker's mtime_ns
        (hashing a 1B checkpoint every save costs seconds of CPU; a link keeps the mtime, a
        copy does not). Each candidate is pinned (linked to a temporary name) before it is
        checked, so a rotation under us cannot swap its inode."""
        try:
            source = resolve_in_pod(record["path"], self.pod_dir)
        except ValueError:          # never link (nor later push) a file outside the pod
            return None
        target = self._retained_path(record["gpu"], record["next_token"], record["sha256"])
        pin = target.with_name(f".{target.name}.pin")
        for _pass in range(2):     # a rotation between the listing and the look: once more
            for candidate in [source, *rotated_names(source)]:
                try:
                    link_or_copy(candidate, pin)
                except FileNotFoundError:
                    continue
                st = pin.stat()
                # Cheap first: a late event's search down the rotated names hashes one file.
                if (size is not None and st.st_size != size) or (
                        mtime_ns is not None and st.st_nlink >= 2
                        and st.st_mtime_ns != mtime_ns):
                    pin.unlink(missing_ok=True)
                    continue
                by_size = size is not None and st.st_size > VERIFY_BELOW_BYTES
                if by_size or sha256_file(pin) == record["sha256"]:
                    os.replace(pin, target)
                    return str(target.relative_to(self.pod_dir))
                pin.unlink(missing_ok=True)
        return None

    def _retained_path(self, gpu: int, next_token: int, sha256: str) -> Path:
        return (self.pod_dir / PASSED_DIR / f"gpu{gpu}"
                / f"token{int(next_token):012d}-{sha256[:12]}.pt")

    def retain_file(self, gpu: int, next_token: int, sha256: str, source: Path) -> str:
        """Retain `source` (known to be `sha256`); returns its pod-relative path."""
        target = self._retained_path(gpu, next_token, sha256)
        link_or_copy(source, target)
        return str(target.relative_to(self.pod_dir))

    def copies_of(self, gpu: int, sha256: str) -> list[Path]:
        """Retained files that should hold these bytes (unverified)."""
        found = []
        record = self.records.get((gpu, sha256))
        if record and record.get("retained"):
            found.append(self.pod_dir / record["retained"])
        gpu_dir = self.pod_dir / PASSED_DIR / f"gpu{gpu}"
        if gpu_dir.is_dir():
            found += sorted(p for p in gpu_dir.glob(f"token*-{sha256[:12]}.pt") if p not in found)
        return found

    def _prune(self, gpu: int) -> None:
        """Keep the KEEP_PASSED newest passed links of a GPU (pending ones stay)."""
        passed = [r for r in self.for_gpu(gpu) if r["verdict"] == PASSED and r.get("retained")]
        for record in passed[:-KEEP_PASSED]:
            (self.pod_dir / record["retained"]).unlink(missing_ok=True)
