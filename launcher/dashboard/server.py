"""`fractus-pod dashboard`: a read-only page of the pod's curves, served on 127.0.0.1.

GET /            the page (static/index.html: uPlot, vendored, no build step)
GET /static/NAME one of the files shipped in static/
GET /api/data?points=N&x=tokens|time&version=V
                 everything the page draws, or only {"version": V, "unchanged": true}
                 while nothing changed (an idle pod costs a few stat calls per poll).
It only reads the pod's files; every answer goes through `status`'s token scrub.
"""

from __future__ import annotations

import json
import math
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

from launcher.dashboard.goodput_files import LedgerSource, goodput_report
from launcher.dashboard.series import PodSeries, metrics_files
from launcher.dashboard.timeline import MARKER_COLORS, read_timeline
from launcher.dashboard.xaxis import X_MODES, pod_axis
from launcher.paths import CANARY_FILE, EVENTS_FILE, ROUNDS_LEDGER, STATE_FILE, SYNC_STATE
from launcher.hub.redact import scrub
from launcher.dashboard.status import collect

STATIC_DIR = Path(__file__).with_name("static")
STATIC_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                ".css": "text/css; charset=utf-8", ".LICENSE": "text/plain; charset=utf-8"}
DEFAULT_POINTS, MAX_POINTS = 1000, 4000
TABLE_REFRESH_S = 30      # ages in the table move without any file changing
LEDGER_S = 30             # the goodput panel's ledger is swept again at most this often
WATCHED = (EVENTS_FILE, STATE_FILE, SYNC_STATE, CANARY_FILE, ROUNDS_LEDGER)


class DashboardData:
    """The pod's files turned into the page's JSON; one lock, as the server is threaded."""

    def __init__(self, pod_dir: Path, config):
        self.pod_dir = pod_dir
        self.config = config
        self.series = PodSeries(pod_dir)
        self.ledger = LedgerSource(pod_dir)
        self.goodput: dict | None = None       # the ledger, recomputed every LEDGER_S at most
        self.goodput_at = -math.inf
        self._lock = threading.Lock()

    def version(self) -> str:
        """Changes with any shown file's size or mtime, and every TABLE_REFRESH_S."""
        paths = [self.pod_dir / rel for rel in WATCHED]
        paths += list(metrics_files(self.pod_dir).values())
        paths.append(self.pod_dir / self.config.manifest)
        parts = [str(int(time.time() // TABLE_REFRESH_S))]
        for path in paths:
            try:
                st = path.stat()
                parts.append(f"{st.st_size}.{st.st_mtime_ns}")
            except FileNotFoundError:
                parts.append("-")
        return format(hash(tuple(parts)) & (2**63 - 1), "x")

    def payload(self, points: int, x_mode: str = X_MODES[0]) -> dict:
        with self._lock:
            version = self.version()
            self.series.refresh()
            curves = self.series.curves(points)
            axis = pod_axis(self.series, x_mode)
            return {
                "version": version,
                "now": time.time(),
                "lines": {str(gpu): s.metrics_lines for gpu, s in self.series.gpus.items()},
                "x": {"mode": axis.mode, "label": axis.label, "knots": axis.knots(),
                      "gaps": list(axis.gaps)},
                "curves": {name: {str(gpu): [_floats(axis.at(ts)), _floats(y)]
                                  for gpu, (ts, y) in per_gpu.items()}
                           for name, per_gpu in curves.items()},
                **read_timeline(self.pod_dir, self.series.newest_ts, axis),
                "marker_colors": MARKER_COLORS,
                "status": collect(self.pod_dir, self.config, goodput=self.fresh_goodput()),
            }

    def fresh_goodput(self) -> dict:
        """The ledger, swept again at most every LEDGER_S (a long run's sweep takes ~1 s)."""
        if self.goodput is None or time.monotonic() - self.goodput_at >= LEDGER_S:
            self.goodput = goodput_report(self.pod_dir, self.config, self.ledger)
            self.goodput_at = time.monotonic()
        return self.goodput


def _floats(values) -> list:
    """JSON numbers; NaN (a null in the metrics) as null, which uPlot draws as a gap."""
    return [None if math.isnan(v) else round(float(v), 6) for v in values.tolist()]


def _scrubbed_json(obj) -> bytes:
    return scrub(json.dumps(obj, default=str, allow_nan=False)).encode()


class DashboardHandler(BaseHTTPRequestHandler):
    data: DashboardData          # set on the subclass make_server builds

    def do_GET(self) -> None:
        url = urlparse(self.path)
        if url.path == "/":
            self._static("index.html")
        elif url.path.startswith("/static/"):
            self._static(url.path[len("/static/"):])
        elif url.path == "/api/data":
            self._data(parse_qs(url.query))
        else:
            self._send(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain")

    def _static(self, name: str) -> None:
        shipped = {p.name: p for p in STATIC_DIR.iterdir() if p.is_file()}
        path = shipped.get(name)          # only the shipped files: no path from the URL
        if path is None:
            self._send(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain")
            return
        kind = STATIC_TYPES.get(path.suffix, "application/octet-stream")
        self._send(HTTPStatus.OK, path.read_bytes(), kind)

    def _data(self, query: dict) -> None:
        try:
            points = int(query.get("points", [DEFAULT_POINTS])[0])
        except ValueError:
            points = DEFAULT_POINTS
        points = min(max(points, 16), MAX_POINTS)
        x_mode = query.get("x", [X_MODES[0]])[0]
        if x_mode not in X_MODES:
            x_mode = X_MODES[0]
        known = query.get("version", [None])[0]
        if known is not None and known == self.data.version():
            body = _scrubbed_json({"version": known, "unchanged": True})
        else:
            body = _scrubbed_json(self.data.payload(points, x_mode))
        self._send(HTTPStatus.OK, body, "application/json")

    def _send(self, status: HTTPStatus, body: bytes, kind: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *args) -> None:     # noqa: A002 (the base's signature)
        pass                                           # no line per poll on the terminal


def make_server(pod_dir: Path, config, host: str, port: int) -> ThreadingHTTPServer:
    """Bound, and the pod's files already read (the first page is then as quick as any)."""
    data = DashboardData(pod_dir, config)
    handler = type("PodDashboardHandler", (DashboardHandler,), {"data": data})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    _scrubbed_json(data.payload(DEFAULT_POINTS))     # reads every line, imports the scrub
    return server
