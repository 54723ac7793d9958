"""One GPU's worker on a Ray node, and the one table that moves it.

Invariant: a handle is in exactly one state, and only `RayHandle.move` changes it, through
TRANSITIONS; a move the table does not list raises IllegalTransition (a bug in RayBackend).
Owner: RayBackend (driver.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from launcher.supervise.backend import WorkerExit, WorkerHandle
from launcher.supervise.state import IllegalTransition


class RayState(str, Enum):
    PLACING = "placing"      # its actor's start() is in flight (`call`)
    RUNNING = "running"      # the start answered: polled once per round trip
    ADOPTING = "adopting"    # its actor died on a live node: a new one there takes over
    FENCING = "fencing"      # its actor died: lost once its node fenced itself (`deadline`)
    ENDED = "ended"          # the worker's exit is known (`ended`)
    LOST = "lost"            # its node fenced itself: WorkerExit(node_lost=True)


class RayEvent(Enum):
    PLACED = "placed"        # the start answered with the worker's pid
    EXITED = "exited"        # an exit code: the worker's, a failed call's, a kill's
    ADOPT = "adopt"          # the actor died, its node lives: a replacement adopts the GPU
    ADOPTED = "adopted"      # the replacement answered: the old worker's final save ended
    DIED = "died"            # the actor died, its node gone (or its adoption failed)
    FENCED = "fenced"        # the fence deadline passed: the node stopped its worker


TRANSITIONS: dict[tuple[RayState, RayEvent], RayState] = {
    (RayState.PLACING, RayEvent.PLACED): RayState.RUNNING,
    (RayState.PLACING, RayEvent.EXITED): RayState.ENDED,
    (RayState.PLACING, RayEvent.DIED): RayState.FENCING,
    (RayState.RUNNING, RayEvent.EXITED): RayState.ENDED,
    (RayState.RUNNING, RayEvent.ADOPT): RayState.ADOPTING,
    (RayState.RUNNING, RayEvent.DIED): RayState.FENCING,
    (RayState.ADOPTING, RayEvent.ADOPTED): RayState.ENDED,
    (RayState.ADOPTING, RayEvent.DIED): RayState.FENCING,
    (RayState.FENCING, RayEvent.FENCED): RayState.LOST,
}


@dataclass(eq=False)
class RayHandle(WorkerHandle):
    actor: object = None
    state: RayState = RayState.PLACING
    call: object = None               # PLACING: its start(); ADOPTING: the replacement's adopt()
    poll_ref: object = None           # RUNNING: the poll in flight (never dropped: has lines)
    deadline: float = 0.0             # ADOPTING: answered by then; FENCING: lost then (monotonic)
    ended: WorkerExit | None = None   # ENDED, LOST: how it ended
    node_id: str | None = None        # the node's full id (NodeAffinity for a replacement)
    metrics: str | None = None        # its metrics file, relative to the node's workdir
    read_to: int | None = None        # the byte of that file the launcher has read up to
    ckpt_sha256: str | None = None    # the bytes this start resumes from, as its entry records

    @property
    def done(self) -> bool:
        return self.state in (RayState.ENDED, RayState.LOST)

    def move(self, event: RayEvent, ended: WorkerExit | None = None) -> None:
        """The one way its state changes; `ended`: how it ended, for ENDED and LOST."""
        to = TRANSITIONS.get((self.state, event))
        if to is None:
            raise IllegalTransition(f"ray gpu {self.gpu}: {event.value} in state "
                                    f"{self.state.value}")
        self.state, self.call = to, None     # a new call in flight is set after the move
        if ended is not None:
            self.ended = ended
