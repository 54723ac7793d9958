"""A webhook receiver on 127.0.0.1 for the alert tests and benchmark: a real HTTP server
that records each POST (path, headers, body, arrival time) and answers 200, 500, or never
(`hang`: it holds the connection until the server closes)."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Received:
    path: str
    headers: dict
    body: bytes
    at: float            # time.time() on arrival

    def json(self):
        return json.loads(self.body)

    @property
    def text(self) -> str:
        return self.body.decode()


class WebhookServer:
    def __init__(self, mode: str = "ok"):
        self.mode = mode
        self.received: list[Received] = []
        self._changed = threading.Condition()
        self._release = threading.Event()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with owner._changed:
                    owner.received.append(Received(self.path, dict(self.headers), body,
                                                   time.time()))
                    owner._changed.notify_all()
                if owner.mode == "hang":
                    owner._release.wait()
                    return
                self.send_response(500 if owner.mode == "500" else 200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever,
                                       kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def url(self, path: str = "/hook") -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}{path}"

    def wait_for(self, count: int, timeout_s: float = 30.0) -> list[Received]:
        """The first `count` requests, once they have arrived (AssertionError after the
        timeout, naming what did arrive)."""
        with self._changed:
            arrived = self._changed.wait_for(lambda: len(self.received) >= count, timeout_s)
            assert arrived, f"{len(self.received)} of {count} requests arrived: " \
                            f"{[r.body[:200] for r in self.received]}"
            return list(self.received[:count])

    def close(self) -> None:
        self._release.set()
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
