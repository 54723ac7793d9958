"""Whether the checkpoint a manifest entry names may be trusted for its GPU: nothing starts
from, retains or pushes a file that is not what its entry says (this GPU, shard, run, phase
and start_token, each where the file records it; v1 and bare legacy files record none).
Loading is memory-mapped: only the pickled header is read, not the weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path, PurePath

from launcher.pod.manifest import RUN_ID_KEY, Manifest, ManifestError, phase_shard
from fractus.config import PRESETS, EngineConfig, load_model_config


@dataclass(frozen=True)
class CheckpointIdentity:
    """What a checkpoint file says about itself (None: not recorded, e.g. a v1 file)."""
    gpu: int | None
    shard: str | None
    run_id: str | None
    next_token: int | None     # full (v2) checkpoints only: the exact resume token
    phase: int | None = None


def read_identity(path: Path, model: str | None = None,
                  pod_dir: Path | None = None) -> CheckpointIdentity:
    """The file's identity, loaded weights-only; ValueError (one line) if it is no Fractus
    checkpoint or does not fit the pod's `model` (relative to `pod_dir`)."""
    # torch (~2 s): paid only when a checkpoint is read, not by every importer of this module
    from fractus.train.checkpoint import is_full, load_checkpoint
    ck = load_checkpoint(path)
    if model is not None:
        _check_model_fit(ck, model, pod_dir)
    config = ck.get("config") if isinstance(ck.get("config"), dict) else {}
    train_state = ck.get("train_state") if is_full(ck) and isinstance(ck["train_state"], dict) \
        else {}
    gpu = train_state.get("gpu", config.get("gpu"))
    next_token = train_state.get("next_token")
    phase = train_state.get("phase")
    return CheckpointIdentity(
        gpu=gpu if isinstance(gpu, int) and not isinstance(gpu, bool) else None,
        shard=train_state.get("shard") if isinstance(train_state.get("shard"), str) else None,
        run_id=train_state.get("run_id") if isinstance(train_state.get("run_id"), str) else None,
        next_token=next_token if isinstance(next_token, int) else None,
        phase=phase if isinstance(phase, int) and not isinstance(phase, bool) else None)


def _check_model_fit(ck: dict, model: str, pod_dir: Path | None) -> None:
    """Its config must be `model`'s and its tensors fit it (by shape on the meta device)."""
    from fractus.legacy import state_mismatch      # torch (~2 s), as above
    if model in PRESETS or pod_dir is None or Path(model).is_absolute():
        wanted = load_model_config(model)
    else:
        wanted = load_model_config(str(pod_dir / model))
    stored = ck.get("config")
    if stored is not None:
        try:
            stored = EngineConfig.from_dict(stored)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"its model config does not load ({exc})") from None
        if stored != wanted:
            raise ValueError(f"it was written for another model than the pod's model: "
                             f"{model!r}")
    state = ck.get("model_state")
    if not isinstance(state, dict):
        raise ValueError("its model_state is not a mapping of tensors")
    mismatch = state_mismatch(wanted, state)
    if mismatch:
        raise ValueError(f"its tensors do not fit model {model!r} ({mismatch})")


def _phase_start(manifest: Manifest, gpu: int, found: CheckpointIdentity, shard_of) -> bool:
    """Whether the entry is a recorded phase switch: token 0 of phase N > 1 on that phase's
    shard, from a checkpoint of phase N-1 trained on phase N-1's shard."""
    entry = manifest.entries[gpu]
    if entry.at_phase < 2 or entry.start_token != 0:
        return False
    if found.phase is not None and found.phase != entry.at_phase - 1:
        return False
    if found.shard is None:
        return False
    try:
        ended, current = shard_of(gpu, entry.at_phase - 1), shard_of(gpu, entry.at_phase)
    except ValueError:
        return False
    return PurePath(found.shard).name == PurePath(ended).name and \
        (entry.shard is None or PurePath(entry.shard).name == PurePath(current).name)


def check_entry(manifest: Manifest, pod_dir: Path, gpu: int, shard_of,
                model: str | None = None, path: Path | None = None) -> None:
    """Refuse (ManifestError, one line) a named checkpoint that is not GPU `gpu`'s own at
    the entry's start_token (or the end of the phase before, at a phase's token 0).
    `shard_of(gpu, phase)`: the config's shard path; `path`: the file to read if not the
    named one (a hub copy fetched for a merge)."""
    entry = manifest.entries.get(gpu)
    name = entry.checkpoint if entry else None
    if not name:
        return
    where = f"manifest {manifest.path}: gpu_{gpu} checkpoint {name}"
    try:
        found = read_identity(path or pod_dir / name, model, pod_dir)
    except ValueError as exc:
        raise ManifestError(f"{where} is not usable ({exc}); restore the file or roll the "
                            f"GPU back") from None
    # At (phase 1, token 0) another GPU's weights are an initialisation, not a resume (a new
    # GPU starts from the merged brain, whose config names GPU 0: adopt --init-new-from).
    if found.gpu is not None and found.gpu != gpu and entry.position > (1, 0):
        raise ManifestError(f"{where} was written by GPU {found.gpu}, not GPU {gpu}; point "
                            f"gpu_{gpu} at its own checkpoint")
    run_id = manifest.extra.get(RUN_ID_KEY)
    if found.run_id is not None and run_id is not None and found.run_id != run_id:
        raise ManifestError(f"{where} belongs to run {found.run_id}, not this pod's run "
                            f"{run_id}; point gpu_{gpu} at a checkpoint of this run")
    if _phase_start(manifest, gpu, found, shard_of):
        return      # the end of the phase before: the switch the launcher recorded
    shard = entry.shard or phase_shard(manifest, gpu, shard_of)
    if found.shard is not None and PurePath(found.shard).name != PurePath(shard).name:
        raise ManifestError(f"{where} was trained on shard {found.shard}, not {shard}; point "
                            f"gpu_{gpu} at a checkpoint of its own shard")
    if found.phase is not None and found.phase != entry.at_phase:
        raise ManifestError(f"{where} was written in data phase {found.phase}, not the "
                            f"entry's phase {entry.at_phase}; point gpu_{gpu} at a checkpoint "
                            f"of its phase")
    if found.next_token is not None and found.next_token != entry.start_token:
        raise ManifestError(f"{where} resumes at token {found.next_token} but the entry's "
                            f"start_token is {entry.start_token}; set start_token to "
                            f"{found.next_token} if that file is the one to resume from")
