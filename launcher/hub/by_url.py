"""Which Store a pod config's `hub:` URL names. Its own module so that store.py (the
interface) imports neither backend: local.py and hf.py import store.py."""

from __future__ import annotations

from pathlib import Path

from .local import FileStore
from .retry import RetryPolicy
from .store import Store


def absolute_hub_url(url: str | None, base: Path) -> str | None:
    """`url` with a relative file:// path made absolute against `base` (a URL typed on the
    command line is relative to the cwd; a Ray node names the head's store); others unchanged."""
    if url and url.startswith("file://") and url[len("file://"):] and \
            not Path(url[len("file://"):]).expanduser().is_absolute():
        return f"file://{(base / url[len('file://'):]).resolve()}"
    return url


def open_store(
    url: str,
    pod_dir: str | Path,
    *,
    endpoint: str | None = None,
    token: str | None = None,
    retry: RetryPolicy = RetryPolicy(),
    timeout_s: float = 10.0,
) -> Store:
    """The store of a `hub:` URL: `file://path` (relative to `pod_dir`) or `hf://owner/repo`
    (`hf://datasets/owner/repo`); `endpoint` defaults to HF_ENDPOINT, `token` to HF_TOKEN or
    the login cache; `timeout_s`: silence allowed to a metadata request. ValueError if bad."""
    pod_dir = Path(pod_dir)
    if url.startswith("file://"):
        raw = url[len("file://"):]
        if not raw:
            raise ValueError(f"hub URL {url!r} names no directory")
        root = Path(raw).expanduser()
        return FileStore(root if root.is_absolute() else pod_dir / root, pod_dir)
    if url.startswith("hf://"):
        # huggingface_hub takes seconds to import: only a pod with an hf:// hub pays it.
        from .hf import HfStore

        return HfStore(url, pod_dir, endpoint=endpoint, token=token, retry=retry, timeout_s=timeout_s)
    raise ValueError(f"hub URL must start with hf:// or file://, got {url!r}")
