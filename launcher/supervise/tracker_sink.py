"""The GPUs' metrics lines (as the monitor reads them) and key events mirrored to trackio
(`tracker:`); the tracker never delays or breaks supervision: a bounded queue drained by a
thread, full means dropped (counted), a tracker that raises turns the sink off (one warning).

One trackio run per GPU (gpu{i}, resumed across launches): each keeps its own step axis
(GPUs restart and roll back apart), and trackio charts a project's runs together. trackio
keeps one current run per context, so each GPU's run lives in its own Context."""

from __future__ import annotations

import contextvars
import os
import queue
import threading
from pathlib import Path

from launcher.config.tracker import TrackerSettings
from launcher.errors import warn
from launcher.paths import TRACKIO_DIR
from launcher.pod.events_tensorboard import merge_scalars

QUEUE_LINES = 10_000          # ~ an hour of 8 GPUs logging every few seconds
_NOT_METRICS = ("type", "ts", "gpu", "step")
_STOP = object()


class TrackerSink:
    def __init__(self, pod_dir: Path, settings: TrackerSettings, open_tracker=None):
        self.settings = settings
        self.store_dir = pod_dir / TRACKIO_DIR
        # open_tracker(gpu) -> an object with log(metrics, step) and finish(); tests give
        # one that raises. Default: a trackio run, imported on the sink's thread only.
        self._open = open_tracker or self._open_trackio
        if open_tracker is None:
            # On the main thread (workers' environments come from os.environ: a thread would
            # race): trackio reads TRACKIO_DIR at import, and a Space or server named in the
            # environment would send the metrics off the pod (`trackio sync` shares them).
            os.environ["TRACKIO_DIR"] = str(self.store_dir)
            for name in ("TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL"):
                os.environ.pop(name, None)
        self._queue: queue.Queue = queue.Queue(maxsize=QUEUE_LINES)
        self._thread: threading.Thread | None = None
        self._pid: int | None = None
        self.dropped = 0
        self.off = False
        self.last_step: dict[int, int] = {}      # each GPU's newest step, for its events

    # ---- the supervisor's side: never blocks, never raises ------------------------------
    def metrics(self, gpu: int, record: dict) -> None:
        step = record.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            return
        self.last_step[gpu] = step
        self._put(gpu, step, {k: v for k, v in record.items() if k not in _NOT_METRICS
                              and isinstance(v, (int, float)) and not isinstance(v, bool)})

    def __call__(self, event: dict) -> None:
        """An EventLog tap: a rollback marks its GPU's run, a stage change and a merge round
        every run (merge/round, merge/adopted, ..., and the GPU's own gate rise)."""
        if event.get("event") == "rollback" and event.get("gpu") in self.last_step:
            gpu = event["gpu"]
            self._put(gpu, self.last_step[gpu], {"rollback": 1})
        elif event.get("event") == "stage_change" and isinstance(event.get("to_stage"), int):
            for gpu, step in list(self.last_step.items()):   # events come from any thread
                self._put(gpu, step, {"stage": event["to_stage"]})
        elif event.get("event") == "merge_round":
            values = merge_scalars(event)
            pod_wide = {t: v for t, v in values.items() if not t.startswith("merge/gate_rise/")}
            for gpu, step in list(self.last_step.items()):
                rise = values.get(f"merge/gate_rise/gpu{gpu}")
                self._put(gpu, step, {**pod_wide,
                                      **({"merge/gate_rise": rise} if rise is not None else {})})

    def _put(self, gpu: int, step: int, values: dict) -> None:
        if self.off or not values:
            return
        try:
            if self._pid != os.getpid():   # first line, or a detached launcher's child
                self._start()
            self._queue.put_nowait((gpu, step, values))
        except queue.Full:
            self.dropped += 1
        except Exception as exc:           # no thread to be had: the pod goes on without
            self.off = True
            warn(f"tracker {self.settings.kind} turned off: {type(exc).__name__}: {exc}")

    def close(self, timeout_s: float = 30.0) -> None:
        """Flush what is queued and finish the runs, for at most `timeout_s`."""
        if self.dropped:
            warn(f"tracker {self.settings.kind}: {self.dropped} metrics line(s) dropped "
                 f"(the tracker fell {QUEUE_LINES} lines behind)")
        if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
            return                # nothing sent, or the sink turned itself off
        try:
            self._queue.put(_STOP, timeout=timeout_s)
        except queue.Full:
            return
        self._thread.join(timeout_s)

    # ---- the sink's thread ----------------------------------------------------------------
    def _start(self) -> None:
        self._pid = os.getpid()
        self._queue = queue.Queue(maxsize=QUEUE_LINES)    # a fork's copy is not ours
        self._thread = threading.Thread(target=self._drain, name="tracker-sink", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        runs: dict = {}
        try:
            while (item := self._queue.get()) is not _STOP:
                gpu, step, values = item
                if gpu not in runs:
                    runs[gpu] = self._open(gpu)
                runs[gpu].log(values, step=step)
            for run in runs.values():
                run.finish()
        except Exception as exc:       # the tracker's failure is never the pod's
            self.off = True
            warn(f"tracker {self.settings.kind} turned off: {type(exc).__name__}: {exc}")

    def _open_trackio(self, gpu: int):
        self.store_dir.mkdir(parents=True, exist_ok=True)
        import trackio          # optional (the tracker extra): only with `tracker:`
        import trackio.utils
        if trackio.utils.TRACKIO_DIR != self.store_dir:     # one store per process
            raise RuntimeError(f"trackio was already imported with its store in "
                               f"{trackio.utils.TRACKIO_DIR}, not in the pod")
        context = contextvars.Context()
        run = context.run(trackio.init, project=self.settings.project, name=f"gpu{gpu}",
                          resume="allow", embed=False, auto_log_gpu=False,
                          auto_log_cpu=False, space_id=None, server_url=None)
        return _InContext(context, run)


class _InContext:
    """A trackio run whose calls run in the Context it was made in (its current run)."""

    def __init__(self, context: contextvars.Context, run):
        self.context, self.run = context, run

    def log(self, values: dict, step: int) -> None:
        self.context.run(self.run.log, values, step)

    def finish(self) -> None:
        self.context.run(self.run.finish)
