"""What a pod config pulled from a hub may set without `--trust-hub-config`: whoever can write
the hub repository must not run code on every pod rebuilt from it (as its checkpoints load
weights-only). A hub's fractus-pod.yaml is data except what it would run or write on this
machine; the list and why: docs/LAUNCHER.md "Hub", `--trust-hub-config`. `alerts:` is refused
too: it names local environment variables the launcher posts to."""

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
    """One short phrase per setting of `config` that would run or write on this machine.
    `ray_address`: the cluster the local user named (launch --ray), replacing the config's."""
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
