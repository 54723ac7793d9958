"""`fractus-pod adopt`: take over a run directory made by the reference trainer, unchanged:
every problem is reported at once (one line each, exit 2) before anything is written, and
running it again changes nothing. What it reads, checks and writes: docs/ADOPT.md.
"""

from __future__ import annotations

import dataclasses
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from fractus.train.env import MERGED_BRAIN
from launcher.paths import ADOPTED_MODEL_FILE, CONFIG_NAME, V1_CHECKPOINT, V1_MANIFESTS, V1_SHARDS
from launcher.pod.adoption_baseline import record_adoption
from launcher.files import atomic_write_text, sha256_file
from launcher.errors import UserError
from launcher.pod.manifest import (Manifest, ManifestEntry, ManifestError, read_manifest,
                                    write_manifest)
from launcher.config.devices import parse_devices
from launcher.config.podconfig import DEFAULT_MANIFESTS, PodConfig, load_pod_config
from launcher.pod.setup_init import write_config
from launcher.pod.progress import progress
from launcher.pod.shards import shard_length
from fractus.config import PRESETS, EngineConfig, load_model_config
from launcher.pod.setup_init import config_text

V1_MODEL = "1b"       # v1 always built its TARGET config: a bare state_dict gets this


class AdoptionRefused(UserError):
    """One or more problems, one line each (the CLI prefixes the first with `error: `)."""

    def __init__(self, problems: list[str]):
        super().__init__("\nerror: ".join(problems))
        self.problems = problems


@dataclass
class AdoptedGpu:
    gpu: int
    checkpoint: str            # relative to the pod
    shard: str
    start_token: int
    shard_tokens: int
    manifests: list[str]       # the manifests that know this GPU (empty: --init-new-from)
    config: object = None      # fractus.config.EngineConfig
    filled: str | None = None  # what loading it fills from the model's construction
    sha256: str = ""
    shard_sha256: str = ""


@dataclass
class Adoption:
    gpus: list[AdoptedGpu]
    manifest: Manifest         # the pod's manifest (the first one found)
    model: str                 # MODEL for the workers (preset name or file)
    devices: str
    shards: str                # the pod config's `shards:` pattern


def _inside(pod_dir: Path, rel: str, what: str, problems: list[str]) -> Path | None:
    path = (pod_dir / rel).resolve()
    if not path.is_relative_to(pod_dir.resolve()):
        problems.append(f"{what} {rel} is outside the run directory {pod_dir}")
        return None
    if not path.is_file():
        problems.append(f"{what} {rel} does not exist")
        return None
    return path


def _read_manifests(pod_dir: Path, only: str | None, problems: list[str]) -> list[Manifest]:
    names = [only] if only else [n for n in V1_MANIFESTS if (pod_dir / n).is_file()]
    if only and not (pod_dir / only).is_file():
        problems.append(f"--manifest {only} does not exist in {pod_dir}")
        return []
    if not names:
        problems.append(f"no resume manifest in {pod_dir} (looked for "
                        f"{', '.join(V1_MANIFESTS)}); give --manifest PATH")
        return []
    manifests = []
    for name in names:
        try:
            manifests.append(read_manifest(pod_dir / name))
        except ManifestError as exc:
            problems.append(str(exc))
    return manifests


def _shard_of(pod_dir: Path, gpu: int, named: str | None) -> str:
    if named:
        return str(named)
    for pattern in V1_SHARDS:
        if (pod_dir / pattern.format(i=gpu)).is_file():
            return pattern.format(i=gpu)
    return V1_SHARDS[0].format(i=gpu)


def _gpu_plan(pod_dir: Path, gpu: int, manifests: list[Manifest], init_new_from: str | None,
              problems: list[str]) -> AdoptedGpu | None:
    known = [(m, m.entries[gpu]) for m in manifests if gpu in m.entries]
    names = [m.path.name for m, _ in known]
    by_token: dict[int, list[str]] = {}
    for m, e in known:
        by_token.setdefault(e.start_token, []).append(m.path.name)
    if len(by_token) > 1:
        listed = " vs ".join(f"start_token {t} in {', '.join(n)}" for t, n in by_token.items())
        problems.append(f"gpu {gpu}: {listed}; adopt one of them with --manifest PATH")
        return None
    if not known:
        if init_new_from is None:
            problems.append(f"gpu {gpu}: not in {', '.join(m.path.name for m in manifests)}; "
                            f"give --init-new-from PATH (e.g. {MERGED_BRAIN}) to start it "
                            f"there at token 0 of its shard, or leave it out of --devices")
            return None
        start, checkpoint, named_shard = 0, init_new_from, None
    else:
        agreed = {}
        for field in ("checkpoint", "shard"):    # the manifests may name them, or not
            named = {str(getattr(e, field)): m.path.name for m, e in known if getattr(e, field)}
            if len(named) > 1:
                listed = " vs ".join(f"{field} {v} in {n}" for v, n in named.items())
                problems.append(f"gpu {gpu}: {listed}; adopt one of them with --manifest PATH")
                return None
            agreed[field] = next(iter(named)) if named else None
        start, named_shard = next(iter(by_token)), agreed["shard"]
        checkpoint = agreed["checkpoint"] or V1_CHECKPOINT.format(i=gpu)
    shard = _shard_of(pod_dir, gpu, named_shard)
    where = f"gpu {gpu}" + (f" ({', '.join(names)})" if names else "")
    ok_ckpt = _inside(pod_dir, checkpoint, f"{where}: checkpoint", problems)
    ok_shard = _inside(pod_dir, shard, f"{where}: shard", problems)
    if ok_ckpt is None or ok_shard is None:
        return None
    try:
        length = shard_length(ok_shard)
    except ManifestError as exc:
        problems.append(f"gpu {gpu}: {exc}")
        return None
    if start > length:
        problems.append(f"gpu {gpu}: start_token {start} is past the end of its shard {shard} "
                        f"({length} tokens)")
        return None
    return AdoptedGpu(gpu, checkpoint, shard, start, length, names)


def _checkpoint_config(path: Path, model: str | None):
    """(the engine config a checkpoint records (a bare state_dict: `model`, default v1's),
    what loading it fills from the model's construction or None)."""
    # torch (~2 s): only when adopting
    from fractus.legacy import state_fit
    from fractus.train.checkpoint import load_checkpoint
    ck = load_checkpoint(path)
    config = load_model_config(model or V1_MODEL) if ck.get("config") is None else \
        EngineConfig.from_dict(ck["config"])
    state = ck["model_state"]
    return config, state_fit(config, state)[1] if isinstance(state, dict) else None


def _configs(pod_dir: Path, gpus: list[AdoptedGpu], model: str | None,
             problems: list[str]) -> None:
    with ThreadPoolExecutor(max_workers=max(1, len(gpus))) as pool:
        futures = [pool.submit(_checkpoint_config, pod_dir / g.checkpoint, model) for g in gpus]
    for g, future in zip(gpus, futures):
        try:
            g.config, g.filled = future.result()
        except Exception as exc:        # a foreign or damaged file: one line, never torch's
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            problems.append(f"gpu {g.gpu}: cannot read checkpoint {g.checkpoint}: {reason[:200]}")
    if model:
        try:
            wanted = load_model_config(model)
        except (ValueError, OSError) as exc:
            problems.append(f"--model: {exc}")
            return
        for g in gpus:
            if g.config is not None and g.config != wanted:
                problems.append(f"gpu {g.gpu}: checkpoint {g.checkpoint} is not --model {model} "
                                f"({_differences(g.config, wanted)})")
    read = [g for g in gpus if g.config is not None]
    for g in read[1:]:
        if g.config != read[0].config:
            problems.append(f"gpu {g.gpu}: checkpoint {g.checkpoint} has another config than "
                            f"gpu {read[0].gpu}'s {read[0].checkpoint} "
                            f"({_differences(g.config, read[0].config)})")


def _differences(a, b) -> str:
    da, db = dataclasses.asdict(a), dataclasses.asdict(b)
    return ", ".join(f"{k} {da[k]} vs {db[k]}" for k in da if da[k] != db[k])


def _model_name(config, model: str | None) -> str | None:
    """MODEL for the workers: --model, else the preset equal to the config, else None."""
    if model:
        return model
    return next((name for name, preset in PRESETS.items() if preset == config), None)


def _shards_pattern(gpus: list[AdoptedGpu], problems: list[str]) -> str:
    patterns = {g.shard.replace(str(g.gpu), "{i}") for g in gpus}
    if len(patterns) == 1:
        pattern = patterns.pop()
        if all(pattern.format(i=g.gpu) == g.shard for g in gpus) and "{i}" in pattern:
            return pattern
    problems.append("the shards do not follow one pattern with the GPU index ("
                    + ", ".join(f"gpu {g.gpu}: {g.shard}" for g in gpus)
                    + "); rename them like data/shard_gpu{i}.pt")
    return ""


def plan_adoption(pod_dir: Path, devices: str | None = None, model: str | None = None,
                  init_new_from: str | None = None, manifest: str | None = None) -> Adoption:
    """Everything adopt would write, checked; raises AdoptionRefused listing every problem."""
    problems: list[str] = []
    manifests = _read_manifests(pod_dir, manifest, problems)
    if problems:
        raise AdoptionRefused(problems)
    known = sorted({gpu for m in manifests for gpu in m.entries})
    devices = devices or (f"cuda:{','.join(map(str, known))}" if known else "cuda")
    try:
        slots = parse_devices(devices)
    except UserError as exc:
        raise AdoptionRefused([str(exc)]) from None
    planned = [_gpu_plan(pod_dir, s.gpu, manifests, init_new_from, problems) for s in slots]
    gpus = [g for g in planned if g is not None]
    if not problems:
        _configs(pod_dir, gpus, model, problems)
    shards = _shards_pattern(gpus, problems) if not problems else ""
    if problems:
        raise AdoptionRefused(problems)
    return Adoption(gpus, manifests[0], _model_name(gpus[0].config, model) or ADOPTED_MODEL_FILE,
                    devices, shards)


def _hash_all(pod_dir: Path, gpus: list[AdoptedGpu]) -> None:
    """sha256 of every checkpoint and shard, in parallel threads (hashlib releases the GIL)."""
    files = sorted({p for g in gpus for p in (g.checkpoint, g.shard)})
    total = sum((pod_dir / rel).stat().st_size for rel in files)
    with progress(f"hashing {len(files)} file(s)", total, "bytes") as task, \
            ThreadPoolExecutor(max_workers=max(1, len(files))) as pool:
        digests = dict(zip(files, pool.map(
            lambda rel: sha256_file(pod_dir / rel, task.advance), files)))
    for g in gpus:
        g.sha256, g.shard_sha256 = digests[g.checkpoint], digests[g.shard]


def _pod_config(pod_dir: Path, adoption: Adoption) -> PodConfig:
    """The existing fractus-pod.yaml, else the defaults, naming the adopted files."""
    base = load_pod_config(pod_dir) if (pod_dir / CONFIG_NAME).is_file() else PodConfig()
    return dataclasses.replace(
        base, model=adoption.model, devices=adoption.devices, shards=adoption.shards,
        checkpoints=V1_CHECKPOINT,
        manifest=str(adoption.manifest.path.relative_to(pod_dir)))


def _write_support_files(pod_dir: Path, config: PodConfig, adoption: Adoption) -> None:
    if adoption.model == ADOPTED_MODEL_FILE:
        path = pod_dir / ADOPTED_MODEL_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(dataclasses.asdict(adoption.gpus[0].config), indent=2) + "\n"
        if not path.is_file() or path.read_text() != text:
            atomic_write_text(path, text)
    for name, rel in (("stages.yaml", config.stages), ("trusted_loss.yaml", config.criteria)):
        target = pod_dir / rel
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(target, (DEFAULT_MANIFESTS / name).read_text())
    for sub in ("checkpoints", "logs"):
        (pod_dir / sub).mkdir(exist_ok=True)


def _complete_manifest(adoption: Adoption) -> bool:
    """Add the GPUs the pod's manifest does not list yet; True if it changed."""
    manifest, changed = adoption.manifest, False
    for g in adoption.gpus:
        if g.gpu in manifest.entries:
            continue
        manifest.add_entry(g.gpu, ManifestEntry(start_token=g.start_token,
                                                checkpoint=g.checkpoint, shard=g.shard))
        changed = True
    return changed


def adopt_run(pod_dir: Path, devices: str | None = None, model: str | None = None,
          init_new_from: str | None = None, manifest: str | None = None) -> Adoption:
    adoption = plan_adoption(pod_dir, devices, model, init_new_from, manifest)
    _hash_all(pod_dir, adoption.gpus)
    config = _pod_config(pod_dir, adoption)
    _write_support_files(pod_dir, config, adoption)
    if not (pod_dir / CONFIG_NAME).is_file() or \
            (pod_dir / CONFIG_NAME).read_text() != config_text(config, "adopted"):
        write_config(pod_dir, config, "adopted")
    if _complete_manifest(adoption):
        write_manifest(adoption.manifest)
    record_adoption(pod_dir, [(g.gpu, g.checkpoint, g.sha256, g.start_token, g.shard,
                               g.shard_sha256) for g in adoption.gpus])
    return adoption


def table(adoption: Adoption) -> list[str]:
    """The per-GPU table adopt prints."""
    rows = [("gpu", "checkpoint", "sha256", "shard", "start_token", "tokens left", "config")]
    for g in adoption.gpus:
        preset = next((n for n, p in PRESETS.items() if p == g.config), None)
        described = preset or ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(g.config).items()
                                        if k in ("vocab_size", "d_model", "n_layers", "n_experts"))
        rows.append((str(g.gpu), g.checkpoint, g.sha256[:12], g.shard, f"{g.start_token:,}",
                     f"{g.shard_tokens - g.start_token:,}", described))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
