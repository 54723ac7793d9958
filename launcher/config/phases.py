"""`shards:` of the pod config: one shard pattern, or an ordered list of data phases,
numbered from 1 as the manifest entry's `phase` (docs/LAUNCHER.md, Data phases).
"""

from __future__ import annotations

from dataclasses import dataclass

from launcher.errors import UserError, refuse_unknown_keys

PHASE_KEYS = ("shard", "name")
# A name is shown in status and events only; a bound keeps a status line one line.
MAX_NAME = 64


@dataclass(frozen=True)
class Phase:
    number: int          # 1-based, the manifest entry's `phase`
    pattern: str         # the shard path with {i} for the GPU
    name: str            # as the user named it, else "phase N"

    def shard(self, gpu: int) -> str:
        return self.pattern.format(i=gpu)


def parse_phases(value, source: str, check_template) -> tuple[Phase, ...]:
    """The phases `shards:` names; `check_template(key, pattern, source)` checks each."""
    if isinstance(value, str):
        check_template("shards", value, source)
        return (Phase(1, value, "phase 1"),)
    example = ("e.g. shards: [data/shard_gpu{i}.pt, data/shard_phase2_gpu{i}.npy], or one "
               "pattern")
    if not isinstance(value, list) or isinstance(value, bool):
        raise UserError(f"{source}: shards must be a path pattern or a list of phases, got "
                        f"{value!r}; {example}")
    if not value:
        raise UserError(f"{source}: shards is an empty list of phases; name at least one "
                        f"shard pattern ({example})")
    phases = []
    for number, item in enumerate(value, start=1):
        where = f"{source}: shards phase {number}"
        if isinstance(item, dict):
            refuse_unknown_keys(item, PHASE_KEYS, where)
            pattern, name = item.get("shard"), item.get("name", f"phase {number}")
            if not isinstance(name, str) or not name.strip() or len(name) > MAX_NAME:
                raise UserError(f"{where}: name must be a non-empty string of at most "
                                f"{MAX_NAME} characters, got {name!r}")
        else:
            pattern, name = item, f"phase {number}"
        if not isinstance(pattern, str):
            raise UserError(f"{where}: expected a shard pattern with {{i}} (or {{shard: ..., "
                            f"name: ...}}), got {pattern!r}")
        check_template("shards", pattern, where)
        phases.append(Phase(number, pattern, name))
    patterns = [p.pattern for p in phases]
    repeated = next((p for p in patterns if patterns.count(p) > 1), None)
    if repeated is not None:
        raise UserError(f"{source}: shards names {repeated!r} in two phases; each phase "
                        f"trains on its own shard")
    return tuple(phases)
