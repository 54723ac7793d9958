"""The pod config (fractus-pod.yaml): how this pod runs, checked whole when it is read.

load_pod_config refuses an unknown key or a bad value in one line (exit 2) before anything
runs, and parses each section once into its typed object, kept beside the person's text.
Paths are relative to the pod directory. Keys: docs/LAUNCHER.md, Pod config keys.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.resources
import re
import string
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from launcher.paths import CONFIG_NAME
from launcher.errors import UserError, check_bool, check_number, refuse_unknown_keys
from launcher.config.devices import parse_devices
from launcher.config.phases import Phase, parse_phases
from launcher.config.yamlfile import read_yaml
from fractus.train.env import ENV_VARS
from fractus.config import PRESETS as MODEL_PRESETS, load_model_config
from launcher.child import is_hub_name
from launcher.config.merge_rounds_settings import MergeRoundSettings
from launcher.config.retention_settings import RetentionSettings
from launcher.config.tracker import TrackerSettings
from launcher.config.ray_settings import RaySettings
from launcher.config.data_settings import DataSource
from launcher.config.alerts import check_alerts
from launcher.config.alerts import AlertSettings

# The shipped stage and criteria files: package data, so an installed wheel has them too.
DEFAULT_MANIFESTS = importlib.resources.files("launcher.config") / "defaults"


@dataclass
class PodConfig:
    model: str = "1b"
    # "auto", "cpu:N", "cuda" or "cuda:0-7" (devices.py).
    devices: str = "auto"
    # One shard pattern, or an ordered list of data phases (launcher/config/phases.py).
    shards: str | list = "data/shard_phase2_gpu{i}.npy"
    checkpoints: str = "checkpoints/fractus_1b_gpu{i}.pt"
    manifest: str = "checkpoints/RESUME_MANIFEST_8GPU.json"
    stages: str = "manifests/stages.yaml"
    criteria: str = "manifests/trusted_loss.yaml"
    # The worker command; "python" means the interpreter running the launcher.
    worker: list = field(default_factory=lambda: ["python", "-u", "-m", "fractus.train.worker"])
    # Extra worker settings for every GPU and stage (e.g. SEQ for a small demo model).
    env: dict = field(default_factory=dict)
    # Names of the launcher's environment variables workers also get (beyond child.py's).
    pass_env: list = field(default_factory=list)
    save_every: int = 800
    save_keep: int = 3
    log_every: int = 40
    poll_interval_s: float = 1.0     # how often the launcher reads the metrics files
    stop_grace_s: float = 120.0      # SIGTERM -> SIGKILL for a worker that must stop
    hub: str | None = None           # "file://hub" or "hf://owner/repo" (see launcher/hub)
    # The hub sync policy: SyncSettings below.
    sync: dict = field(default_factory=lambda: {"interval": 3600})
    # How much of the run the hub keeps (retention_settings.py). None: every push is kept.
    retention: dict | None = None
    # `init` writes synthetic shards with these (tiny preset); unused otherwise.
    demo_data: dict | None = None
    # Run the workers on a Ray cluster (ray_settings.py). None: child processes here.
    ray: dict | None = None
    # Where launch fetches the shards from (data_settings.py). None: the user places them.
    data: "DataSource | None" = None
    # Webhooks told of failures, rollbacks, refused pushes (alerts.py).
    alerts: dict | None = None
    # The GPUs' metrics mirrored to trackio (tracker.py). None: off.
    tracker: dict | None = None
    # `disk_low` below this free, before a save fails (a 1B checkpoint + optimizer: ~12 GiB).
    disk_low_gib: float = 20.0
    # What one GPU-hour costs (any currency), for the goodput ledger. None: hours only.
    price_per_gpu_hour: float | None = None
    # Train, merge, train (merge_rounds_settings.py). None: no rounds, each GPU alone.
    merge_rounds: dict | None = None

    # The file the config was read from (load_pod_config), named in a section's refusal.
    _source = None

    @property
    def phases(self) -> tuple[Phase, ...]:
        return self._parsed("shards", lambda raw, where: parse_phases(
            raw, self._source or "shards", _check_template))

    def _parsed(self, key: str, parse):
        """Section `key` parsed once by parse(raw, where), kept until its raw value changes."""
        raw, cached = getattr(self, key), self.__dict__.get("_typed_" + key)
        if cached is None or cached[0] != raw:
            where = f"{self._source}: {key}" if self._source else key
            cached = (copy.deepcopy(raw), parse(raw, where))
            self.__dict__["_typed_" + key] = cached
        return cached[1]

    def phase(self, number: int) -> Phase:
        """Phase `number` (1-based); ValueError past the last."""
        if not 1 <= number <= len(self.phases):
            raise ValueError(f"phase {number} is not one of the {len(self.phases)} phase(s) "
                             f"shards: lists")
        return self.phases[number - 1]

    def shard_path(self, gpu: int, phase: int = 1) -> str:
        """GPU `gpu`'s shard in phase `phase` (1: the first, or the only one)."""
        return self.phase(phase).shard(gpu)

    def shard_paths(self, gpu: int) -> list[str]:
        """Every phase's shard of GPU `gpu`, in phase order."""
        return [phase.shard(gpu) for phase in self.phases]

    def checkpoint_path(self, gpu: int) -> str:
        return self.checkpoints.format(i=gpu)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def sync_settings(self) -> "SyncSettings":
        return self._parsed("sync", SyncSettings.parse)

    def alert_settings(self) -> "AlertSettings | None":
        return self._parsed("alerts", AlertSettings.parse)

    def tracker_settings(self) -> "TrackerSettings | None":
        return self._parsed("tracker", TrackerSettings.parse)

    def retention_settings(self) -> "RetentionSettings | None":
        return self._parsed("retention", RetentionSettings.parse)

    def merge_round_settings(self) -> "MergeRoundSettings | None":
        return self._parsed("merge_rounds", MergeRoundSettings.parse)


# Commits an hour one Hub repository takes (the Hub is reported to cap them at 128).
HUB_COMMITS_PER_HOUR = 128
COMMITS_PER_HOUR_RANGE = (1, 36000)
INTERVAL_MIN_S = 1.0                 # sync.interval: below a second no push even completes


@dataclass(frozen=True)
class SyncSettings:
    """`sync:` of the pod config: when the launcher pushes to the hub, and how hard it tries."""
    interval_s: float = 3600.0       # the user's hourly cadence
    merge: bool = False              # also push the mean of the GPUs' checkpoints
    attempts: int = 5                # tries of one hub call (5xx, timeouts) before a sync fails
    backoff_s: float = 1.0           # wait before the second try; doubles after each failure
    commits_per_hour: int = HUB_COMMITS_PER_HOUR    # the hf:// repo's commit budget

    @classmethod
    def parse(cls, data: dict, source: str = "sync") -> "SyncSettings":
        data = dict(data or {})
        if "interval_s" in data:     # the older name of interval, still read
            if "interval" in data:
                raise UserError(f"{source}: give interval or interval_s, not both")
            data["interval"] = data.pop("interval_s")
        refuse_unknown_keys(data, _SYNC_CHECKS, source)
        return cls(**{"interval_s" if key == "interval" else key:
                      _SYNC_CHECKS[key](value, f"{source}.{key}") for key, value in data.items()})


# Each key of `sync:` and its check (value, where) -> the typed value.
_SYNC_CHECKS = {
    "interval": lambda v, at: _seconds(v, at, minimum=INTERVAL_MIN_S),
    "merge": check_bool,
    "attempts": lambda v, at: check_number(v, at, 1, 100),
    "backoff_s": lambda v, at: _seconds(v, at, minimum=0),
    "commits_per_hour": lambda v, at: check_number(
        v, at, *COMMITS_PER_HOUR_RANGE, why=f" (the hub repo's commits an hour; the Hub's is "
                                            f"{HUB_COMMITS_PER_HOUR})")}


_UNITS = {"s": 1, "m": 60, "h": 3600}


def _seconds(value, what: str, minimum: float = 0.1, maximum: float = 30 * 86400) -> float:
    """A duration: a number of seconds, or a string like "90s", "30m", "1h"."""
    seconds = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str) and value[:-1] and value[-1] in _UNITS:
        try:
            seconds = float(value[:-1]) * _UNITS[value[-1]]
        except ValueError:
            seconds = None
    if seconds is None or not minimum <= seconds <= maximum:
        raise UserError(f"{what} must be a duration from {minimum:g}s to {maximum:g}s (e.g. "
                        f"3600, \"30m\", \"1h\"), got {value!r}")
    return seconds


PRESETS: dict[str, PodConfig] = {
    # The CPU demo and tests: two tiny workers on synthetic shards, a local hub store.
    "tiny-cpu": PodConfig(
        # ALLOW_FRESH_START: the demo starts new random models (a real run never does).
        model="tiny", devices="cpu:2", env={"SEQ": "32", "ALLOW_FRESH_START": "1"},
        save_every=25, save_keep=3,
        log_every=5, poll_interval_s=0.5, stop_grace_s=30.0, hub="file://hub",
        disk_low_gib=1.0,          # its checkpoints are kilobytes, not the 1B run's GiBs
        sync={"interval": 600},
        demo_data={"tokens": 1_000_000, "vocab": 512, "seed": 0}),
    # The production run: eight GPUs, the user's cadence (log every 40, save every 800).
    "1b-8gpu": PodConfig(model="1b", devices="cuda:0-7", hub=None),
}


# Every number of the pod config, with its inclusive range (NaN passes `< 0`, not these).
NUMERIC_RANGES: dict[str, tuple[float, float]] = {
    "save_every": (0, 10**9),
    "save_keep": (1, 1000),
    "log_every": (1, 10**9),
    "poll_interval_s": (0.05, 3600),
    "stop_grace_s": (0, 86400),
    "disk_low_gib": (0, 10**9),
    "price_per_gpu_hour": (0, 10**6),
}
# Keys whose default is None, with the type a given value must have.
_OPTIONAL_TYPES = {"hub": str, "demo_data": dict, "ray": dict, "data": dict, "alerts": dict,
                   "retention": dict, "tracker": dict, "price_per_gpu_hour": float,
                   "merge_rounds": dict}
# A path template may hold {i} only: no other field, spec or conversion ("{i:>999999999}"
# would allocate).
_TEMPLATE_FIELDS = ("i",)


def _check_template(key: str, value: str, source: str) -> None:
    fix = f"write it like {getattr(PodConfig(), key)!r}, with {{i}} for the GPU index"
    if not isinstance(value, str):
        raise UserError(f"{source}: {key} must be a path string, got {value!r}; {fix}")
    try:
        parts = list(string.Formatter().parse(value))
    except ValueError as exc:
        raise UserError(f"{source}: {key} {value!r} is not a path template ({exc}); {fix}") \
            from None
    fields = [(name, spec, conversion) for _, name, spec, conversion in parts
              if name is not None]
    if not any(name == "i" for name, _, _ in fields):
        raise UserError(f"{source}: {key} must contain {{i}} (the GPU index), got {value!r}; "
                        f"{fix}")
    for name, spec, conversion in fields:
        if name not in _TEMPLATE_FIELDS or spec or conversion:
            shown = "{" + name + (f"!{conversion}" if conversion else "") + \
                (f":{spec}" if spec else "") + "}"
            raise UserError(f"{source}: {key} {value!r} holds {shown}; only {{i}} may be "
                            f"used (write a literal brace as {{{{ or }}}}); {fix}")


# Worker settings only the launcher sets: a worker pausing at boundaries no launcher merges
# would wait for ever.
LAUNCHER_ONLY_VARS = ("MERGE_INBOX", "MERGE_EVERY", "MERGE_ORIGIN")


def _check_env(env: dict, source: str) -> None:
    """env: names worker settings only (a misspelt one would silently reach no worker)."""
    for name, value in env.items():
        if not isinstance(name, str) or name not in ENV_VARS:
            raise UserError(f"{source}: env: {name!r} is not a worker setting; remove it or "
                            f"use one of {', '.join(ENV_VARS)} (docs/WORKER.md)")
        if isinstance(value, (dict, list)) or value is None:
            raise UserError(f"{source}: env: {name} must be a string or number, got "
                            f"{value!r}")
        if name in LAUNCHER_ONLY_VARS:
            raise UserError(f"{source}: env: {name} is the launcher's to set (merge rounds); "
                            f"remove it and use a merge_rounds: section")


def _check_types(data: dict, source: str) -> None:
    fields = {f.name: f for f in dataclasses.fields(PodConfig)}
    refuse_unknown_keys(data, fields, source)
    defaults = PodConfig()
    for key, value in data.items():
        default = getattr(defaults, key)
        if value is None and key in _OPTIONAL_TYPES:
            continue
        if key == "shards":
            continue        # a pattern or a list of phases: parse_phases checks it below
        expected = type(default) if default is not None else _OPTIONAL_TYPES[key]
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            continue
        if isinstance(value, bool) or not isinstance(value, expected):
            raise UserError(f"{source}: {key} must be {_KIND[expected]}, got {value!r}")
    for key, (low, high) in NUMERIC_RANGES.items():
        if data.get(key) is not None and not low <= data[key] <= high:
            raise UserError(f"{source}: {key} must be between {low:g} and {high:g}, got "
                            f"{data[key]!r}; the default is {getattr(defaults, key)!r}")
    if "checkpoints" in data:
        _check_template("checkpoints", data["checkpoints"], source)
    if "env" in data:
        _check_env(data["env"], source)
    if data.get("hub") is not None:
        _check_hub_url(data["hub"], source)
    if data.get("demo_data") is not None:
        _check_demo_data(data["demo_data"], source)


# demo_data: the synthetic shards `init` writes (tokens per shard, vocabulary, seed).
DEMO_DATA_RANGES = {"tokens": (1, 10**9), "vocab": (2, 1 << 20), "seed": (0, 2**32 - 1)}


def _check_demo_data(demo: dict, source: str) -> None:
    refuse_unknown_keys(demo, DEMO_DATA_RANGES, f"{source}: demo_data")
    for key, (low, high) in DEMO_DATA_RANGES.items():
        check_number(demo.get(key), f"{source}: demo_data.{key}", low, high)


def check_model(pod_dir: Path, config: PodConfig) -> None:
    """Refuse a `model:` the worker cannot build, before any worker starts."""
    name = config.model
    if name in MODEL_PRESETS:
        return
    path = Path(name) if Path(name).is_absolute() else pod_dir / name
    try:
        load_model_config(str(path))
    except (ValueError, TypeError, OSError, yaml.YAMLError) as exc:
        reason = " ".join(str(exc).split())[:200]
        raise UserError(f"{pod_dir / CONFIG_NAME}: model {name!r} cannot be built ({reason}); "
                        f"use one of {sorted(MODEL_PRESETS)} or a .json/.yaml of the model's "
                        f"constructor keywords") from None


# How a type is named in a refusal ("must be an integer", never "must be a int").
_KIND = {int: "an integer", float: "a number", str: "a string", list: "a list",
         dict: "a mapping"}


def _check_hub_url(url: str, source: str) -> None:
    """The hub's scheme, checked when the config is read (status, sync, launch alike)."""
    if not (url.startswith("file://") and len(url) > len("file://")) and \
            not (url.startswith("hf://") and len(url) > len("hf://")):
        raise UserError(f"{source}: hub must be file://DIR or hf://OWNER/REPO, got {url!r}; "
                        f"fix hub: or remove it")


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _check_pass_env(names: list, source: str) -> None:
    for name in names:
        if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
            raise UserError(f"{source}: pass_env entries must be variable names like "
                            f"WANDB_API_KEY, got {name!r}")
        if is_hub_name(name):
            raise UserError(f"{source}: pass_env: {name} is the hub's (only the launcher "
                            f"talks to the hub); remove it from pass_env")


def load_pod_config(pod_dir: Path) -> PodConfig:
    path = pod_dir / CONFIG_NAME
    if not path.exists():
        raise UserError(f"no {CONFIG_NAME} in {pod_dir}: run `fractus-pod init` first")
    data = read_yaml(path, "pod config") or {}
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a mapping of settings (key: value lines); "
                        f"`fractus-pod init --force` writes a fresh one")
    _check_types(data, str(path))
    config = PodConfig(**data)
    config.env = {str(k): str(v) for k, v in config.env.items()}
    config._source = str(path)
    _check_pass_env(config.pass_env, str(path))
    # Each section parsed here, once, and kept typed: a mistake fails before anything runs.
    config.phases, config.sync_settings(), config.retention_settings()
    config.tracker_settings(), config.merge_round_settings()
    RaySettings.check(config.ray, source=f"{path}: ray")
    config.data = DataSource.parse(config.data, f"{path}: data")
    check_alerts(config.alert_settings(), config.pass_env, str(path))
    parse_devices(config.devices)      # fail early on a malformed devices string
    return config
