"""What a pod config pulled from a hub may set without the local user saying so.

Whoever can write the hub repository must not run code on every pod rebuilt from it, just as
checkpoints from the same hub load weights-only so that no code runs. A hub's
fractus-pod.yaml is data (model, cadence, worker settings) except for what it would run or
where it would write on this machine:

- `worker:` other than fractus-pod's own worker command;
- `pass_env:` (the local environment handed to children; `env:` itself holds worker
  settings only, launcher/config/podconfig.py refuses any other name such as LD_PRELOAD);
- `alerts:` (it names local environment variables the launcher posts to: the user's own
  webhook URLs, chosen by the user);
- paths outside the new pod: the manifest, checkpoints, stage and criteria files and a model
  file (the rebuild and the run write or read them there), the shards when the config would
  synthesise them, and file-naming worker settings (CKPT_IN, ...) in `env:` or a stage.

`launch --from-hub URL --trust-hub-config` takes them as they are.
"""

from __future__ import annotations

from pathlib import Path

from fractus.train.env import PATH_VARS
from launcher.config.podconfig import PodConfig
from launcher.config.stages import Stage
from launcher.pod.manifest import resolve_in_pod

MODEL_FILE_SUFFIXES = (".json", ".yaml", ".yml")


def _outside(pod_dir: Path, path: str) -> bool:
    try:
        resolve_in_pod(path, pod_dir)
    except ValueError:
        return True
    return False


def _names_a_file(name: str, value: str) -> bool:
    # MODEL is a preset name or a constructor-keywords file.
    return name in PATH_VARS and (name != "MODEL" or value.endswith(MODEL_FILE_SUFFIXES))


def _outside_settings(pod_dir: Path, settings: dict[str, str]) -> list[str]:
    return [name for name, value in sorted(settings.items())
            if _names_a_file(name, value) and _outside(pod_dir, value)]


def untrusted_config(config: PodConfig, pod_dir: Path) -> list[str]:
    """What `config` (pulled from a hub into `pod_dir`) sets that would run or write on
    this machine, one short phrase each; empty when it is data only."""
    found = []
    if config.worker != PodConfig().worker:
        found.append(f"worker: {config.worker}")
    outside = _outside_settings(pod_dir, config.env)
    if outside:
        found.append(f"env: {', '.join(outside)} outside the pod")
    if config.pass_env:
        found.append(f"pass_env: {', '.join(config.pass_env)}")
    if config.alerts:
        found.append("alerts: (webhooks read from this machine's environment)")
    paths = {"manifest": config.manifest, "checkpoints": config.checkpoint_path(0),
             "stages": config.stages, "criteria": config.criteria}
    if config.model.endswith(MODEL_FILE_SUFFIXES):
        paths["model"] = config.model
    if config.demo_data or config.data:   # the rebuild or launch would write shards there
        paths["shards"] = config.shard_path(0)
    found += [f"{key}: {path} outside the pod" for key, path in paths.items()
              if _outside(pod_dir, path)]
    return found


def untrusted_stages(stages: dict[int, Stage], pod_dir: Path) -> list[str]:
    """File-naming settings of a hub's stage file that point outside the pod."""
    return [f"stage {number} settings: {', '.join(names)} outside the pod"
            for number, stage in sorted(stages.items())
            if (names := _outside_settings(pod_dir, stage.settings))]


def refusal(url: str, found: list[str]) -> str:
    """The one line that says what was refused and how the user takes it anyway."""
    return (f"--from-hub: the hub's pod config would run or write on this machine: "
            f"{'; '.join(found)}; nothing was taken (the directory is left empty); if you "
            f"trust whoever can write {url}, rerun with --trust-hub-config")
