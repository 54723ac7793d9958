"""`ray:` of the pod config (or `launch --ray ADDRESS`): which Ray cluster runs the workers.
Parsed without importing Ray.
"""

from __future__ import annotations

from dataclasses import dataclass

from launcher.errors import UserError, check_number, refuse_unknown_keys

DEFAULT_WORKDIR = "{pod}/nodes/{node}"


@dataclass(frozen=True)
class RaySettings:
    address: str                        # the cluster's GCS address, host:port (or "auto")
    # Each node's own directory for its workers' files; {pod}: the head's pod path, {node}: the id.
    workdir: str = DEFAULT_WORKDIR
    # The resource one worker takes; None: one GPU (cuda) or one CPU (cpu).
    resource: str | None = None
    # Fencing (launcher/supervise/ray/fence.py): the longest a node that has not heard from
    # the launcher waits before it stops its worker; heartbeats may tell it a shorter one
    # (docs/LAUNCHER.md, Multi-node pods on Ray).
    fence_s: float = 60.0

    KEYS = ("address", "workdir", "resource", "fence_s")
    TEXT_KEYS = ("address", "workdir", "resource")
    FENCE_RANGE_S = (5.0, 3600.0)    # above a few heartbeats (2 s); below an hour

    @classmethod
    def parse(cls, data: dict | None, address: str | None = None,
              source: str = "ray") -> "RaySettings | None":
        """None when neither the config nor --ray asks for Ray."""
        if data is None and address is None:
            return None
        data = cls.check(data, source)
        address = address or data.get("address")
        if not address:
            raise UserError(f"{source}: give the cluster's address (ray: {{address: HOST:PORT}} "
                            f"or launch --ray HOST:PORT)")
        return cls(address, data.get("workdir", DEFAULT_WORKDIR), data.get("resource"),
                   float(data.get("fence_s", cls.fence_s)))

    @classmethod
    def check(cls, data: dict | None, source: str = "ray") -> dict:
        """The `ray:` mapping's keys and values (its address may come from --ray instead)."""
        data = dict(data or {})
        refuse_unknown_keys(data, cls.KEYS, source)
        if "fence_s" in data:
            check_number(data["fence_s"], f"{source}.fence_s", *cls.FENCE_RANGE_S,
                         "a number of seconds")
        for key, value in data.items():
            if key in cls.TEXT_KEYS and (not isinstance(value, str) or not value):
                raise UserError(f"{source}.{key} must be a non-empty string, got {value!r}")
        if "{node}" not in data.get("workdir", DEFAULT_WORKDIR):
            raise UserError(f"{source}.workdir must contain {{node}} (each node its own "
                            f"directory), got {data['workdir']!r}")
        return data
