"""A pod's files as tests read and write them: the manifest's path, a file written under the
pod, and every file's bytes."""

from __future__ import annotations

from pathlib import Path

MANIFEST = "checkpoints/RESUME_MANIFEST_8GPU.json"


def write_file(pod: Path, rel: str, data: bytes) -> Path:
    """`data` at `rel` under the pod, its folders made: the path."""
    path = pod / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def tree(pod: Path) -> dict[str, bytes | None]:
    """Every name under the pod with its bytes (None for a directory or a FIFO)."""
    out = {}
    for path in sorted(pod.rglob("*")):
        rel = path.relative_to(pod).as_posix()
        out[rel] = path.read_bytes() if path.is_file() else None
    return out
