"""Where the fake backend's checkpoints are (tests/support/fake_backend.py), for the real
CheckpointCustodian: no node, no hub of its own; the test says what the hub holds and what
the nodes pushed.

By default its checkpoints are on this machine, as LocalCopies keeps them; with `on_nodes`
they are on the workers' nodes, as RayCustodian keeps them (NodeCopies' probe names,
restore and rollback points). Passed checkpoints it would have a node push are recorded in
`kept`.
"""

from __future__ import annotations

from launcher.supervise.custodian import LocalCopies, NodeCopies


class FakeCopies(LocalCopies):
    def __init__(self, pod_dir, config, events, backend, on_nodes: bool = False):
        super().__init__(pod_dir, config, events)
        self.backend, self.on_nodes = backend, on_nodes
        self.kept: list[tuple[int, dict]] = []   # passed checkpoints handed to a node
        self.hub: dict[int, dict] = {}           # gpu -> its hub copy, set by the test
        self.pushed: list[dict] = []             # node pushes not yet taken by the supervisor
        self.closed = False

    def _where(self):
        return NodeCopies if self.on_nodes else LocalCopies

    def probe_name(self, record, event, rel):
        return self._where().probe_name(self, record, event, rel)

    def restore(self, gpu, manifest, index):
        return self._where().restore(self, gpu, manifest, index)

    def restore_point(self, gpu, launch):
        return self._where().restore_point(self, gpu, launch)

    def keep(self, gpu: int, record: dict) -> None:
        self.kept.append((gpu, record))

    def hub_copy(self, gpu: int) -> dict | None:
        return self.hub.get(gpu)

    def take_pushed(self) -> list[dict]:
        pushed, self.pushed = self.pushed, []
        return pushed

    def close(self, abandoned=lambda: False) -> None:
        self.closed = True

    # ---- what the test makes a node do ---------------------------------------------------
    def push(self, gpu: int, record: dict, revision: str) -> None:
        """GPU `gpu`'s node pushed its passed checkpoint `record` to the hub."""
        self.pushed.append({**record, "gpu": gpu, "hub_revision": revision,
                            "node": self.backend.current(gpu).node})

    def push_refused(self, message: str) -> None:
        """A node's push was refused: another pod took the run over (as RayCustodian
        hears it from a node)."""
        self.lease.refused(message, "node push")
