"""AR probes on the Ray nodes: `NodeProbes`, ProbeMonitor.use_nodes for RayCustodian."""

from __future__ import annotations

from launcher.supervise.ray.driver import CALL_TIMEOUT_S, RayBackend, remote_error
from launcher.supervise.ray.node_checkpoints import RESUME
from launcher.checks.probe_check import ProbeLost, ProbeUnavailable


class NodeProbes:
    """Each AR probe runs on its GPU's node, which holds the checkpoint."""

    def __init__(self, backend: RayBackend):
        self.backend = backend

    def hold(self, gpu: int, checkpoint: str, sha256: str | None) -> str | None:
        """The node's name for it: `sha256:HEX`, or "resume" for the one its worker resumed
        from."""
        if sha256 == RESUME:
            return RESUME
        return f"sha256:{sha256}" if sha256 else None

    def run(self, request, *, timeout_s: float, **options) -> dict:
        """Blocking (ProbeMonitor's probe thread): the node's result dict."""
        ray = self.backend.ray
        actor = self.backend.actor(request.gpu)
        if actor is None:
            raise ProbeLost(f"GPU {request.gpu} has no node now")
        ref = actor.probe.remote(request.checkpoint, request.shard, timeout_s=timeout_s,
                                 **options)
        try:
            return ray.get(ref, timeout=timeout_s + CALL_TIMEOUT_S)
        except ray.exceptions.RayActorError:
            raise ProbeLost(f"GPU {request.gpu}'s node was lost during the probe") from None
        except ray.exceptions.RayError as exc:
            cause = getattr(exc, "cause", None)
            raise ProbeUnavailable(str(cause) if isinstance(cause, ProbeUnavailable)
                                   else remote_error(exc)) from None
