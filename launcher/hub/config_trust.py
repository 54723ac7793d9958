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
  synthesise them, and file-naming worker settings (CKPT_IN, ...) in `env:` or a stage;
- `ray:` naming a cluster the local user did not (`address`, unless `launch --ray ADDRESS`
  overrides it: a driver unpickles what that cluster's actors send, and the workers train
  there), or a node `workdir` outside `{pod}` (the head is often a node too).

`launch --from-hub URL --trust-hub-config` and `sync pull --from URL --trust-hub-config`
take them as they are.
"""

from __future__ import annotations

from pathlib import Path

from fractus.train.env import PATH_VARS
from launcher.config.podconfig import PodConfig
from launcher.config.ray_settings import DEFAULT_WORKDIR
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


def _untrusted_ray(ray: dict | None, pod_dir: Path, ray_address: str | None) -> list[str]:
    found = []
    ray = ray or {}
    if ray.get("address") and ray_address is None:
        found.append(f"ray.address: {ray['address']} (a cluster the hub names; give yours "
                     f"with --ray ADDRESS)")
    workdir = ray.get("workdir", DEFAULT_WORKDIR)
    head, _, rest = workdir.partition("/")
    if head != "{pod}" or _outside(pod_dir, rest.replace("{node}", "node") or "."):
        found.append(f"ray.workdir: {workdir} outside {{pod}}")
    return found


def untrusted_config(config: PodConfig, pod_dir: Path,
                     ray_address: str | None = None) -> list[str]:
    """What `config` (pulled from a hub into `pod_dir`) sets that would run or write on
    this machine, one short phrase each; empty when it is data only. `ray_address`: the
    cluster the local user named (launch --ray), which replaces the config's."""
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
    if config.ray is not None:
        found += _untrusted_ray(config.ray, pod_dir, ray_address)
    return found


def untrusted_stages(stages: dict[int, Stage], pod_dir: Path) -> list[str]:
    """File-naming settings of a hub's stage file that point outside the pod."""
    return [f"stage {number} settings: {', '.join(names)} outside the pod"
            for number, stage in sorted(stages.items())
            if (names := _outside_settings(pod_dir, stage.settings))]


def refusal(url: str, found: list[str], command: str = "--from-hub",
            left: str = "the directory is left empty") -> str:
    """The one line that says what was refused and how the user takes it anyway."""
    return (f"{command}: the hub's pod config would run or write on this machine: "
            f"{'; '.join(found)}; nothing was taken ({left}); if you "
            f"trust whoever can write {url}, rerun with --trust-hub-config")
