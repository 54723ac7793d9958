"""A pod's files as tests read them: the manifest's path and every file's bytes."""

from __future__ import annotations

from pathlib import Path

MANIFEST = "checkpoints/RESUME_MANIFEST_8GPU.json"


def tree(pod: Path) -> dict[str, bytes | None]:
    """Every name under the pod with its bytes (None for a directory or a FIFO)."""
    out = {}
    for path in sorted(pod.rglob("*")):
        rel = path.relative_to(pod).as_posix()
        out[rel] = path.read_bytes() if path.is_file() else None
    return out
