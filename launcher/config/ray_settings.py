"""`ray:` of the pod config (or `launch --ray ADDRESS`): which Ray cluster runs the workers.

Parsed without importing Ray, so a config is checked on machines that lack it.
"""

from __future__ import annotations

from dataclasses import dataclass

from launcher.errors import UserError, refuse_unknown_keys

DEFAULT_WORKDIR = "{pod}/nodes/{node}"


@dataclass(frozen=True)
class RaySettings:
    address: str                        # the cluster's GCS address, host:port (or "auto")
    # Each node's own directory for its workers' checkpoints, metrics and logs; {pod} is
    # the pod directory's absolute path on the head, {node} the node's id (12 characters).
    workdir: str = DEFAULT_WORKDIR
    # The resource one worker takes: none means one GPU (cuda devices) or one CPU (cpu);
    # a custom resource (`ray start --resources='{"fractus_gpu": 8}'`) for the CPU demo.
    resource: str | None = None

    KEYS = ("address", "workdir", "resource")

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
        return cls(address, data.get("workdir", DEFAULT_WORKDIR), data.get("resource"))

    @classmethod
    def check(cls, data: dict | None, source: str = "ray") -> dict:
        """The `ray:` mapping's keys and values (its address may come from --ray instead)."""
        data = dict(data or {})
        refuse_unknown_keys(data, cls.KEYS, source)
        for key, value in data.items():
            if not isinstance(value, str) or not value:
                raise UserError(f"{source}.{key} must be a non-empty string, got {value!r}")
        if "{node}" not in data.get("workdir", DEFAULT_WORKDIR):
            raise UserError(f"{source}.workdir must contain {{node}} (each node its own "
                            f"directory), got {data['workdir']!r}")
        return data
