"""Each GPU's worker starts as a Ray pod's checkpoints need them: lineage, bytes found nowhere.

Invariant: an older lineage's recovery copies never serve. A GPU's lineage (`attempt`: the
start whose recovery copies continue its manifest entry) is set when a start answers, kept by
a new start only when it resumes from that start's recovery copy, cleared when its worker is
killed; logs/ray_lineage.json keeps it for the next launch after a kill -9. Owner: `GpuStarts`.
"""

from __future__ import annotations

from pathlib import Path

from launcher.config.podconfig import PodConfig
from launcher.files import read_json_state, write_json_state
from launcher.hub.by_url import absolute_hub_url
from launcher.hub.lease import pod_id
from launcher.paths import RAY_LINEAGE_FILE
from launcher.supervise.ray.recovery import is_recovery
from launcher.supervise.ray.recovery_staging import gpu_commit_every_s


class GpuStarts:
    def __init__(self, pod_dir: Path, config: PodConfig, gpus: int = 1):
        self.pod_dir = pod_dir
        self.hub_url = absolute_hub_url(config.hub, pod_dir)
        # The data source's credentials are each node's own.
        self.node_args = {
            "hub_url": self.hub_url, "writer": pod_id(pod_dir) if self.hub_url else None,
            "data": {"url": absolute_hub_url(config.data.url, pod_dir),
                     "revision": config.data.revision} if config.data else None,
            "recovery_every_s": gpu_commit_every_s(self.hub_url, gpus,
                                                   config.sync_settings().commits_per_hour)}
        self.recorded = read_lineage(pod_dir)     # the last launcher's, until a start answers
        self.current: dict[int, str | None] = {}  # this launcher's starts
        self.gone: dict[int, dict] = {}

    def attempt(self, gpu: int) -> str | None:
        """The GPU's lineage (None: none); before this launcher started it, the last one's."""
        return self.current[gpu] if gpu in self.current else self.recorded.get(gpu)

    def starting(self, gpu: int, ckpt_in: str | None) -> None:
        self.started(gpu, self.attempt(gpu) if ckpt_in and is_recovery(ckpt_in) else None)

    def started(self, gpu: int, attempt: str | None) -> None:
        self.current[gpu] = attempt
        self._record(gpu, attempt)

    def killed(self, gpu: int) -> None:
        self._record(gpu, None)

    def _record(self, gpu: int, attempt: str | None) -> None:
        """Durably, before what follows can be lost with this launcher."""
        if self.recorded.get(gpu) != attempt:
            if attempt is None:
                self.recorded.pop(gpu, None)
            else:
                self.recorded[gpu] = attempt
            write_json_state(self.pod_dir / RAY_LINEAGE_FILE,
                             {str(g): a for g, a in self.recorded.items()})

    def nowhere(self, gpu: int, sha256: str | None, error: str) -> None:
        """The GPU's node found its start's resume bytes nowhere (BytesNowhere)."""
        self.gone[gpu] = {"sha256": sha256, "error": error}

    def take_bytes_gone(self, gpu: int) -> dict | None:
        """{sha256, error} of the bytes found nowhere at the GPU's last start, once."""
        return self.gone.pop(gpu, None)


def read_lineage(pod_dir: Path) -> dict[int, str]:
    """GPU -> its lineage as the last launcher recorded it (anything else is ignored)."""
    state = read_json_state(pod_dir / RAY_LINEAGE_FILE)
    return {int(gpu): attempt for gpu, attempt in state.items()
            if gpu.isdigit() and isinstance(attempt, str) and attempt}
