"""Which Store a pod config's `hub:` URL names (file:// or hf://), and that URL as another
directory names the same store (absolute_hub_url).

Its own module so that store.py (the interface) imports neither backend: local.py and hf.py
import store.py.
"""

from __future__ import annotations

from pathlib import Path

from .local import FileStore
from .retry import RetryPolicy
from .store import Store


def absolute_hub_url(url: str | None, base: Path) -> str | None:
    """`url` with a relative file:// store made absolute against `base`, for whoever names
    the store from elsewhere: a URL typed on the command line is relative to the current
    directory, not to the pod it fills; a Ray node names the head's pod's store. Other URLs
    (hf://, absolute file://, None) unchanged. The same rule as open_store's."""
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
    """Open the store named by a pod config's `hub:` URL.

    - `file://path`: embedded store on local disk; a relative path is resolved against
      `pod_dir` (`file://hub` -> `<pod_dir>/hub`), `file:///abs/path` is absolute.
    - `hf://owner/repo` (model repo) or `hf://datasets/owner/repo`: Hugging Face Hub via
      `huggingface_hub.HfApi`. `endpoint` defaults to `HF_ENDPOINT`, `token` to `HF_TOKEN`
      or the client's login cache. `retry` bounds the backoff on transient failures;
      `timeout_s` is how long a metadata request may stay silent before it is retried.

    Raises ValueError for a URL of another scheme or a malformed one.
    """
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
