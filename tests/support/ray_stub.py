"""Just enough of a Ray driver and a RayBackend for RayCustodian without a cluster: each
GPU's actor answers a push at once, with the revision the test chose or the error it
raised on the node (tests/test_custodian.py); and a Ray driver for the heartbeat thread
alone, whose refs say whether their actor answered (`HeartbeatRay`: tests/test_ray_heartbeat.py,
tests/test_ray_fence_deadlines.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


class NodeCallError(Exception):
    """What ray.get raises for a call that raised on the node (RayTaskError): `cause`."""

    def __init__(self, cause: Exception):
        super().__init__(str(cause))
        self.cause = cause


@dataclass(eq=False)
class Ref:
    value: object = None
    error: Exception | None = None


class StubRay:
    def wait(self, refs, num_returns=1, timeout=None):
        return list(refs), []

    def get(self, ref):
        if ref.error is not None:
            raise NodeCallError(ref.error)
        return ref.value


@dataclass(eq=False)
class StubActor:
    answer: object = "rev-1"               # a revision, or the exception the node raises
    pushes: list = field(default_factory=list)

    @property
    def push(self):
        return self

    def remote(self, sha256, path, message):
        self.pushes.append((sha256, path, message))
        if isinstance(self.answer, Exception):
            return Ref(error=self.answer)
        return Ref(self.answer)


class StubRayBackend:
    """RayBackend's accessor for its custodian (`actor(gpu)`, `node(gpu)`, `on_lost`), and
    GpuStarts's (`hub_url`, `attempt(gpu)`): RayCustodian(stub, stub)."""

    def __init__(self, pod_dir, config, events, gpus=(0, 1), hub_url="file://hub"):
        self.pod_dir, self.config, self.events = pod_dir, config, events
        self.ray, self.hub_url, self.on_lost = StubRay(), hub_url, []
        self.actors = {g: StubActor() for g in gpus}
        self.attempts: dict[int, str] = {}      # the worker start each GPU's node reported

    def attempt(self, gpu: int) -> str | None:
        return self.attempts.get(gpu)

    def actor(self, gpu: int):
        return self.actors.get(gpu)

    def node(self, gpu: int) -> str:
        return f"node-{gpu}"

    def lose(self, gpu: int) -> None:
        """The GPU's node was lost (RayBackend._lost)."""
        self.actors.pop(gpu)
        for forget in self.on_lost:
            forget(gpu)


class HeartbeatRayError(Exception):
    pass


@dataclass(eq=False)
class HeartbeatRef:
    answered: bool              # the actor's answer came back


class HeartbeatRay:
    """ray.wait/ray.get over refs with `answered`: what the test decided the actor did."""

    class exceptions:
        RayError = HeartbeatRayError

    def wait(self, refs, num_returns=1, timeout=None):
        ready = [r for r in refs if r.answered]
        if len(ready) < num_returns and timeout:
            time.sleep(timeout)         # what ray.wait does when an answer never comes
        return ready, [r for r in refs if not r.answered]

    def get(self, ref, timeout=None):
        return None
