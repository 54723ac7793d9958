"""A new pod on disk, all or nothing: `init`'s files (fractus-pod.yaml from a preset, the
shipped stage and criteria files), the preset's demo shards, and what is missing before a
launch."""

from __future__ import annotations

import dataclasses
import os
import re
import secrets
import shutil
from pathlib import Path

import yaml

from launcher.config.devices import parse_devices
from launcher.config.podconfig import DEFAULT_MANIFESTS, PRESETS, PodConfig, load_pod_config
from launcher.config.stages import load_stages
from launcher.errors import UserError
from launcher.files import atomic_write_text
from launcher.paths import CONFIG_NAME, INIT_STAGING_PREFIX

# Values `init` sets in its copy of the criteria file, per preset: (section, key) -> value.
# The tiny demo's free-run CE moves by a quarter between checkpoints and its ema_tf wanders
# ~0.15 nats on a plateau: the 1B run's band (0.25) and tolerance (0.15) would fail it on noise.
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


@dataclasses.dataclass
class NewPod:
    """What `create_pod` put on disk (paths under the pod) and what it found there."""
    config: PodConfig
    written: list[Path]          # fractus-pod.yaml, the stage and criteria files it copied
    kept: list[Path]             # the user's stage/criteria files, left as they were
    shards: list[Path]           # the preset's synthetic shards
    stages: list[int]            # the stage numbers of the pod's stage file


def init_pod(pod_dir: Path, preset: str, force: bool = False) -> tuple[list[Path], list[Path]]:
    """`create_pod` without demo shards: (written, kept)."""
    pod = create_pod(pod_dir, preset, force=force)
    return pod.written, pod.kept


def create_pod(pod_dir: Path, preset: str, force: bool = False,
               demo_shards: bool = False) -> NewPod:
    """Write fractus-pod.yaml, copy the shipped stage/criteria files (one already in the pod
    is the user's: kept even with `force`) and, with `demo_shards`, the synthetic shards.
    All or nothing: staged and checked on the pod's own file system, then moved into place."""
    if preset not in PRESETS:
        raise UserError(f"unknown preset {preset!r}: expected one of {sorted(PRESETS)}")
    if pod_dir.exists() and not pod_dir.is_dir():
        raise UserError(f"--pod-dir {pod_dir} is a file, not a folder; name a new or existing "
                        f"folder")
    if (pod_dir / CONFIG_NAME).exists() and not force:
        raise UserError(f"{pod_dir / CONFIG_NAME} already exists (use --force to overwrite)")
    config = dataclasses.replace(PRESETS[preset])
    texts, kept = {CONFIG_NAME: config_text(config, preset)}, []
    for name, rel in (("stages.yaml", config.stages), ("trusted_loss.yaml", config.criteria)):
        if (pod_dir / rel).exists():
            kept.append(pod_dir / rel)
            continue
        text = (DEFAULT_MANIFESTS / name).read_text()
        if name == "trusted_loss.yaml" and preset in CRITERIA_EDITS:
            text = edit_yaml_values(text, CRITERIA_EDITS[preset])
        texts[rel] = text
    target = anchor = pod_dir.resolve()
    while not anchor.exists():      # the nearest folder that exists: the staging goes there
        anchor = anchor.parent
    staging = anchor / f"{INIT_STAGING_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
    missing = target.relative_to(anchor).parts
    root = staging.joinpath(*missing[1:])   # the pod inside the staging folder
    try:
        staging.mkdir()
        root.mkdir(parents=True, exist_ok=True)
        for rel, text in texts.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(root / rel, text)
        for sub in ("checkpoints", "data", "logs"):
            (root / sub).mkdir(exist_ok=True)
        loaded = load_pod_config(root)
        stage_file = root / loaded.stages
        if not stage_file.exists():
            stage_file = pod_dir / loaded.stages      # the user's, kept
        stages = sorted(load_stages(stage_file))
        shards = write_demo_shards(root, loaded) if demo_shards and loaded.demo_data else []
        shards = [pod_dir / Path(p).relative_to(root) for p in shards]
        if missing:
            staging.rename(anchor / missing[0])       # a new pod appears whole, at once
        else:
            _refuse_clashes(staging, target)
            _move_into(staging, target)
            staging.rmdir()
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise UserError(f"cannot write the pod {pod_dir}: {exc.strerror or exc}; init wrote "
                        f"nothing: choose a shorter --pod-dir, free space or fix permissions, "
                        f"then run init again") from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return NewPod(loaded, [pod_dir / rel for rel in texts], kept, shards, stages)


def _refuse_clashes(staged: Path, target: Path) -> None:
    """UserError if a staged folder would land on a file of the pod, or a file on a folder."""
    for entry in staged.iterdir():
        dest = target / entry.name
        if entry.is_dir() and dest.is_dir():
            _refuse_clashes(entry, dest)
        elif dest.exists() and entry.is_dir() != dest.is_dir():
            raise UserError(f"{dest} is a {'folder' if dest.is_dir() else 'file'} where init "
                            f"puts a {'folder' if entry.is_dir() else 'file'}; move it away "
                            f"and run init again (init wrote nothing)")


def _move_into(staged: Path, target: Path) -> None:
    """Rename every entry of `staged` into `target`, merging folders, replacing files."""
    for entry in staged.iterdir():
        dest = target / entry.name
        if entry.is_dir() and dest.is_dir():
            _move_into(entry, dest)
            entry.rmdir()
        else:
            os.replace(entry, dest)


def missing_shards_fix(pod_dir: Path, missing: list[str]) -> str:
    """What is missing and how to fix it, in one line (up to eight named, then a count)."""
    shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8
                                      else "")
    return (f"{len(missing)} token shard(s) missing: {shown}; put them there, or "
            f"set `shards:` in {pod_dir / CONFIG_NAME} to where they are (a path with {{i}} "
            f"for the GPU)")


def missing_shards(pod_dir: Path, config: PodConfig) -> list[str]:
    """The config's shard paths (every device, every phase) that are not files yet."""
    try:
        slots = parse_devices(config.devices)
    except UserError:
        return []
    return [rel for s in slots for rel in config.shard_paths(s.gpu)
            if not (pod_dir / rel).is_file()]


def write_demo_shards(pod_dir: Path, config: PodConfig) -> list[Path]:
    """The preset's synthetic shards: the same seed gives the same tokens, so a pod rebuilt
    from the hub regenerates exactly the data it trained on."""
    from fractus.data import synth      # torch (~2 s): only when demo shards are written
    d = config.demo_data or {}
    n = len(parse_devices(config.devices))
    return synth(pod_dir / Path(config.shard_path(0)).parent, shards=n,
                 tokens=int(d["tokens"]), vocab=int(d["vocab"]), seed=int(d["seed"]))
