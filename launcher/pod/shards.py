"""A token shard as the worker reads it: its length, or why what is there is no shard file.
Used before anything starts (launch's checks, adopt, status)."""

from __future__ import annotations

from pathlib import Path

from launcher.pod.manifest import ManifestError


def shard_length(path: Path) -> int:
    """Tokens in a shard, read the way the worker reads it (fractus.data.TokenShard: .npy
    headers and .pt files memory-mapped, never loaded whole): a shard the worker would
    refuse (2-D, float, empty file) is refused here, before anything starts."""
    from fractus.data import ShardError, TokenShard   # torch (~2 s): paid when a shard is read
    try:
        return len(TokenShard(path))
    except ShardError as exc:
        raise ManifestError(f"{exc}; write the GPU's tokens there as a 1-D integer array "
                            f"(e.g. np.save(path, tokens.astype(np.uint16)))") from None


def shard_kind_problem(path: Path) -> str | None:
    """Why `path` is no shard file though something is there (None: a file, or nothing)."""
    if not path.exists() or path.is_file():
        return None
    kind = "a directory" if path.is_dir() else "not a regular file (a FIFO, socket or device)"
    return f"shard {path} is {kind}; put the GPU's token file there"
