"""A Hugging Face Hub on 127.0.0.1 for tests: the protocol subset `HfApi` uses for our calls.

Served with the stdlib ThreadingHTTPServer on a free loopback port:
- POST /api/repos/create                                   create_repo
- GET  /api/{models|datasets}/{repo}[/revision/{rev}]      repo_info
- POST /api/{type}s/{repo}/preupload/{rev}                 upload modes (lfs / regular)
- POST /{repo}.git/info/lfs/objects/batch                  LFS batch API (upload actions)
- PUT  /_lfs/{oid}, POST /_lfs/{oid}/verify                LFS upload (sha256 checked) + verify
- POST /api/{type}s/{repo}/commit/{rev}                    NDJSON commit, parentCommit enforced
- HEAD/GET /{repo}/resolve/{rev}/{path}                    downloads: X-Repo-Commit, ETag,
                                                           X-Linked-Etag/-Size, Range support
- GET  /api/{type}s/{repo}/tree/{rev}[/{path}]             tree listing
- GET  /api/{type}s/{repo}/commits/{rev}                   list_repo_commits
- GET  /api/{type}s/{repo}/lfs-files (Link paging)        list_lfs_files
- POST /api/{type}s/{repo}/lfs-files/batch                 permanently_delete_lfs_files
                                                           (tests/support/hub_lfs_files.py)

Xet is never advertised (no X-Xet-* headers); uploads need the client's documented switch
HF_HUB_DISABLE_XET=1 (the fixture sets it), otherwise a client with hf_xet installed asks for
a xet token and gets a 501 that says so. Faults (see hub_repo.Fault) are set per test via
`server.faults.add(route, kind, ...)`; every request is recorded in `server.requests`.
`server.rate_limits.set(route, limit, window_s)` makes a route answer 429 past `limit`
requests per fixed window, with `Retry-After` and `RateLimit`/`RateLimit-Policy` headers as
the Hub sends them, and counts the requests that came before a 429's Retry-After (`early`).
Run standalone (for benchmarks): `python -m tests.support.hub_server --root DIR`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Iterator

import pytest

from .hub_handler import HubHandler, Request
from .hub_repo import Commit, Faults, HubState, RateLimits


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    hub: "HubServer"


class HubServer:
    """The test hub. Use as a context manager, or start()/stop()."""

    def __init__(self, root: Path, token: str | None = None):
        self.state = HubState(Path(root))
        self.faults = Faults()
        self.rate_limits = RateLimits()
        self.token = token
        self.lfs_page_size = 100          # list_lfs_files' page; a test lowers it to page
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        self._httpd = _Server(("127.0.0.1", 0), HubHandler)  # port 0: a free port
        self._httpd.hub = self
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def _record(self, request: Request) -> None:
        with self._lock:
            self.requests.append(request)

    def routed(self, route: str, method: str | None = None) -> list[Request]:
        with self._lock:
            return [r for r in self.requests if r.route == route and method in (None, r.method)]

    def commits(self, repo_id: str, repo_type: str = "model") -> list[Commit]:
        """Commits on main, newest first."""
        with self.state.lock:
            return self.state.repo(repo_type, repo_id).log("main")

    def start(self) -> "HubServer":
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="test-hub", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __enter__(self) -> "HubServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


TEST_TOKEN = "hf_test_secret_" + "Zq8x" * 6


@pytest.fixture
def test_hub(tmp_path, monkeypatch) -> Iterator[HubServer]:
    """A running test hub requiring TEST_TOKEN; HF_ENDPOINT/HF_TOKEN point the client at it.

    Xet uploads are switched off with the client's documented switch (HF_HUB_DISABLE_XET;
    the constant is read at import, so the already-imported module is patched too), and the
    client's login cache is moved into tmp_path so no real credentials are ever read.
    """
    from huggingface_hub import constants

    progress = importlib.import_module("huggingface_hub.utils.tqdm")  # module, not the class
    monkeypatch.setattr(progress, "HF_HUB_DISABLE_PROGRESS_BARS", True)
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "hf_home" / "token"))
    monkeypatch.setenv("HF_TOKEN", TEST_TOKEN)
    with HubServer(tmp_path / "hub_data", token=TEST_TOKEN) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        yield hub


def main() -> None:
    parser = argparse.ArgumentParser(description="serve the test hub on 127.0.0.1 until killed")
    parser.add_argument("--root", type=Path, required=True, help="where LFS objects are kept")
    parser.add_argument("--token", default=None)
    parser.add_argument("--url-file", type=Path, help="write the server URL here once listening")
    args = parser.parse_args()
    with HubServer(args.root, token=args.token) as hub:
        if args.url_file:
            tmp = args.url_file.with_suffix(".tmp")
            tmp.write_text(hub.url)
            os.replace(tmp, args.url_file)
        print(hub.url, flush=True)
        threading.Event().wait()


if __name__ == "__main__":
    main()
