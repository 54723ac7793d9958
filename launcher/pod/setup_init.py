"""A new pod on disk: `init`'s files (fractus-pod.yaml from a preset, the stage and criteria
files copied from manifests/), the preset's synthetic demo shards, and what is missing before
a launch. The config's schema and parsing live in launcher/config/podconfig.py."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import yaml

from launcher.config.devices import parse_devices
from launcher.config.podconfig import DEFAULT_MANIFESTS, PRESETS, PodConfig
from launcher.errors import UserError
from launcher.files import atomic_write_text
from launcher.paths import CONFIG_NAME

# Values `init` sets in its copy of the criteria file, per preset: (section, key) -> value.
# The tiny demo model's free-run CE (the probe's AR) sits in the hundreds of nats and moves
# by a quarter between checkpoints: the 1B run's band of 0.25 nats would fail it at random.
# Its ema_tf, on synthetic shards, wanders by about 0.15 nats around a plateau after a few
# thousand steps: the 1B run's trend tolerance of 0.15 rolled the README demo back on noise
# (+0.1501 over the window minimum).
CRITERIA_EDITS: dict[str, dict[tuple[str, str], object]] = {
    "tiny-cpu": {("probe", "relativeBand"): 1.0, ("checks", "tolerance"): 0.5},
}


def edit_yaml_values(text: str, edits: dict[tuple[str, str], object]) -> str:
    """Set `key` under top-level `section` in YAML text, keeping every comment around it."""
    out, section, done = [], None, set()
    for line in text.splitlines(keepends=True):
        top = re.match(r"^([A-Za-z_]\w*):", line)
        if top:
            section = top.group(1)
        nested = re.match(r"^(\s+)([A-Za-z_]\w*):", line)
        if nested and (section, nested.group(2)) in edits:
            key = (section, nested.group(2))
            line = f"{nested.group(1)}{key[1]}: {edits[key]}  # set by `init` for this preset\n"
            done.add(key)
        out.append(line)
    missing = set(edits) - done
    if missing:
        raise ValueError(f"criteria file has no {sorted(missing)} to set")
    return "".join(out)


def config_text(config: PodConfig, preset: str) -> str:
    """fractus-pod.yaml's text for `config` (`preset`: where it came from, for the header)."""
    header = (f"# fractus-pod config (preset {preset}). Paths are relative to this directory.\n"
              f"# Keys: see docs/LAUNCHER.md. Stage settings: {config.stages}; "
              f"health thresholds: {config.criteria}.\n")
    return header + yaml.safe_dump(config.to_dict(), sort_keys=False)


def write_config(pod_dir: Path, config: PodConfig, preset: str) -> Path:
    path = pod_dir / CONFIG_NAME
    atomic_write_text(path, config_text(config, preset))
    return path


def init_pod(pod_dir: Path, preset: str, force: bool = False) -> tuple[list[Path], list[Path]]:
    """Write fractus-pod.yaml and copy the default stage/criteria files. Returns (written,
    kept): a stage or criteria file already in the pod is the user's (the docs tell them to
    edit it), so it is kept, even with `force`, which only overwrites the pod config."""
    if preset not in PRESETS:
        raise UserError(f"unknown preset {preset!r}: expected one of {sorted(PRESETS)}")
    pod_dir.mkdir(parents=True, exist_ok=True)
    if (pod_dir / CONFIG_NAME).exists() and not force:
        raise UserError(f"{pod_dir / CONFIG_NAME} already exists (use --force to overwrite)")
    config = dataclasses.replace(PRESETS[preset])
    written, kept = [write_config(pod_dir, config, preset)], []
    for name, rel in (("stages.yaml", config.stages), ("trusted_loss.yaml", config.criteria)):
        target = pod_dir / rel
        source = DEFAULT_MANIFESTS / name
        if target.resolve() == source.resolve():
            continue    # the pod is the repository itself
        if target.exists():
            kept.append(target)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        text = source.read_text()
        if name == "trusted_loss.yaml" and preset in CRITERIA_EDITS:
            text = edit_yaml_values(text, CRITERIA_EDITS[preset])
        atomic_write_text(target, text)
        written.append(target)
    for sub in ("checkpoints", "data", "logs"):
        (pod_dir / sub).mkdir(exist_ok=True)
    return written, kept


def missing_shards_fix(pod_dir: Path, missing: list[str]) -> str:
    """What is missing and how to fix it: said by `init` as the next step, by `launch` as
    its refusal."""
    # Up to a production pod's eight named, then a count: one line stays readable.
    shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8
                                      else "")
    return (f"{len(missing)} token shard(s) missing: {shown}; put them there, or "
            f"set `shards:` in {pod_dir / CONFIG_NAME} to where they are (a path with {{i}} "
            f"for the GPU)")


def missing_shards(pod_dir: Path, config: PodConfig) -> list[str]:
    """The shard paths of the config's devices, every phase's, that are not files yet
    (relative to the pod)."""
    try:
        slots = parse_devices(config.devices)
    except UserError:
        return []
    return [rel for s in slots for rel in config.shard_paths(s.gpu)
            if not (pod_dir / rel).is_file()]


def write_demo_shards(pod_dir: Path, config: PodConfig) -> list[Path]:
    """The preset's synthetic shards (`demo_data`): the same seed always gives the same tokens,
    so a pod rebuilt from the hub regenerates exactly the data it trained on."""
    from fractus.data import synth      # torch (~2 s): only when demo shards are written
    d = config.demo_data or {}
    n = len(parse_devices(config.devices))
    return synth(pod_dir / Path(config.shard_path(0)).parent, shards=n,
                 tokens=int(d["tokens"]), vocab=int(d["vocab"]), seed=int(d["seed"]))
