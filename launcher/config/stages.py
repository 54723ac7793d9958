"""The staged roll-out (manifests/stages.yaml): per stage, the worker settings it runs with."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fractus.train.env import ENV_VARS
from launcher.errors import UserError, check_bool, check_number, refuse_unknown_keys
from launcher.config.yamlfile import read_yaml


MAX_WINDOW = 10**9          # steps; as the pod config's save_every and log_every


@dataclass(frozen=True)
class Stage:
    number: int
    name: str
    exact: bool             # an implementation swap proven equal to the reference
    window: int             # steps each GPU must pass its checks before the stage counts
    settings: dict          # worker environment variables (strings)


def parse_stages(data, source: str = "stages") -> dict[int, Stage]:
    if not isinstance(data, dict) or not isinstance(data.get("stages"), dict):
        raise UserError(f"{source}: expected a mapping 'stages:' of stage number -> stage")
    known = set(ENV_VARS)     # the worker's settings, from their single source of truth
    stages: dict[int, Stage] = {}
    for key, spec in data["stages"].items():
        if isinstance(key, bool) or not isinstance(key, int) or key < 1:
            raise UserError(f"{source}: stage key {key!r} must be an integer >= 1")
        where = f"{source}: stage {key}"
        if not isinstance(spec, dict):
            raise UserError(f"{where}: expected a mapping")
        refuse_unknown_keys(spec, {"name", "exact", "window", "settings"}, where)
        settings = spec.get("settings") or {}
        if not isinstance(settings, dict):
            raise UserError(f"{where}: settings must be a mapping of VAR: value")
        bad = sorted(set(settings) - known)
        if bad:
            raise UserError(f"{where}: settings {bad} are not worker settings; use the "
                            f"names in docs/WORKER.md (e.g. BATCH, CE_CHUNK)")
        window = check_number(spec.get("window", 0), f"{where}: window", 0, MAX_WINDOW)
        exact = check_bool(spec.get("exact", False), f"{where}: exact")
        stages[key] = Stage(number=key, name=str(spec.get("name", f"stage {key}")),
                            exact=exact, window=window,
                            settings={str(k): _env_value(v) for k, v in settings.items()})
    if not stages:
        raise UserError(f"{source}: no stages defined; start from the repository's "
                        f"manifests/stages.yaml")
    expected = list(range(1, len(stages) + 1))
    if sorted(stages) != expected:
        raise UserError(f"{source}: stages must be numbered 1..{len(stages)} without gaps, "
                        f"got {sorted(stages)}")
    return stages


def _env_value(value) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def load_stages(path: str | Path) -> dict[int, Stage]:
    return parse_stages(read_yaml(path, "stages file"), str(path))


def get_stage(stages: dict[int, Stage], number: int) -> Stage:
    if number not in stages:
        raise UserError(f"unknown stage {number}: this pod defines stages 1..{max(stages)}; "
                        f"pick one of them, or add stage {number} to the stages file")
    return stages[number]
