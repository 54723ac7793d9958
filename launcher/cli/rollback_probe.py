"""`fractus-pod rollback` (the automatic rollback, by hand) and `fractus-pod probe` (the AR
probe of a GPU's checkpoint), and their bodies."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click

from launcher.cli.options import pod_dir_of, pod_dir_option
from launcher.files import atomic_write_text, read_json_state
from launcher.paths import BASELINES_FILE
from launcher.pod.ckpt_index import FAILED, PASSED, CheckpointIndex
from launcher.errors import UserError
from launcher.pod.events import EventLog
from launcher.pod.lock import PodLock, read_holder
from launcher.pod.manifest import (
    ManifestError,
    apply_rollback,
    current_stage,
    event_position,
    read_manifest,
    write_manifest,
)
from launcher.config.devices import parse_devices
from launcher.config.podconfig import load_pod_config
from launcher.config.stages import get_stage, load_stages
from launcher.pod.live_state import write_rollback_request
from launcher.hub.sync import note_manifest_changed
from launcher.pod.failed_resume import set_aside
from launcher.pod.live_state import read_pod_state
from launcher.checks.canary import resume_point
from launcher.checks.probe_check import (
    Baseline,
    ProbeUnavailable,
    probe_verdict,
    run_probe_process,
)
from launcher.checks.probe_outcome import stage_baseline
from launcher.checks.trusted_loss import load_criteria_file


def manual_rollback(pod_dir: Path, to_stage: int, gpus: list[int]) -> str:
    """Restore `gpus` to their newest passed checkpoints and set the pod to `to_stage`: a
    running launcher is asked to (its automatic rollback path); else done here, under the
    pod lock."""
    config = load_pod_config(pod_dir)
    get_stage(load_stages(pod_dir / config.stages), to_stage)
    holder = read_holder(pod_dir)
    _refuse_going_up(pod_dir, config, to_stage, running=holder is not None)
    if holder is not None:
        _refuse_during_canary(pod_dir)
        write_rollback_request(pod_dir, to_stage, gpus, holder.get("launcher_id"))
        return (f"asked the running launcher (pid {holder.get('pid')}) to roll back to stage "
                f"{to_stage}" + (f" restoring GPU(s) {gpus}" if gpus else ""))
    with PodLock(pod_dir):
        manifest = read_manifest(pod_dir / config.manifest)
        index = CheckpointIndex(pod_dir)
        events = EventLog(pod_dir)
        targets = {}
        for gpu in gpus:
            if gpu not in manifest.entries:
                raise UserError(f"GPU {gpu} has no manifest entry to roll back")
            target = index.newest_passed(gpu)
            history = index.for_gpu(gpu)
            if target is None and (not history or any(r["verdict"] == PASSED
                                                      for r in history)):
                # (No history: a run this launcher never ran; its own file is its progress.)
                raise UserError(f"GPU {gpu} has no passed checkpoint left intact on disk to "
                                f"restore (see logs/checkpoints.jsonl): restore one (e.g. "
                                f"`fractus-pod sync pull`) or edit the manifest")
            targets[gpu] = target     # None: it wrote checkpoints and none passed
        lines = []
        for gpu, target in targets.items():
            if target is None:       # nothing it wrote ever passed: back to where it began
                lines.append(_start_over(pod_dir, config, manifest, index, events, gpu,
                                         to_stage))
                continue
            for record in index.for_gpu(gpu):
                if event_position(record) > event_position(target) and \
                        record["verdict"] != FAILED:
                    index.mark(gpu, record["sha256"], FAILED, "rolled back by hand")
            events.emit("rollback", gpu=gpu, from_stage=manifest.entries[gpu].stage,
                        to_stage=to_stage, from_token=manifest.start_token(gpu),
                        to_token=target["next_token"], checkpoint=target["path"],
                        reason="by hand", automatic=False)
            apply_rollback(manifest, gpu, target, to_stage)
            lines.append(f"GPU {gpu}: restored token {target['next_token']:,} ({target['path']})")
        from_stage = current_stage(None, manifest)
        manifest.set_stage(to_stage)
        if manifest.entries:
            write_manifest(manifest)
        events.emit("stage_change", from_stage=from_stage, to_stage=to_stage,
                    reason="rollback by hand")
        if config.hub:
            # No launcher to push it: the next one does at its first poll, or `sync push`.
            note_manifest_changed(pod_dir, "rollback by hand")
    lines.append(f"pod set to stage {to_stage}; resume with `fractus-pod launch --stage {to_stage}`")
    if config.hub:
        lines.append(f"the hub ({config.hub}) still holds the pod as it was: `fractus-pod sync "
                     f"push` pushes the rollback now (the next launch pushes it at its start)")
    return "\n".join(lines)


def _start_over(pod_dir: Path, config, manifest, index, events, gpu: int,
                to_stage: int) -> str:
    """No checkpoint of the GPU passed: to token 0, its files set aside, as automatic does."""
    for record in index.for_gpu(gpu):
        if record["verdict"] != FAILED:
            index.mark(gpu, record["sha256"], FAILED, "rolled back by hand")
    entry = manifest.entries[gpu]
    moved = set_aside(pod_dir, config.checkpoint_path(gpu))
    events.emit("rollback", gpu=gpu, from_stage=entry.stage, to_stage=to_stage,
                from_token=entry.start_token, to_token=0, checkpoint=None, set_aside=moved,
                reason="by hand; nothing it wrote passed: it starts over", automatic=False)
    entry.start_over()
    return f"GPU {gpu}: nothing it wrote passed: starts over at token 0"


def _refuse_during_canary(pod_dir: Path) -> None:
    """During the canary nothing has switched yet (and a request would wait for ever)."""
    if (read_pod_state(pod_dir) or {}).get("pod_state") == "canary":
        raise UserError("the running launcher is running its stage canary (nothing has "
                        "switched yet): wait for the pod to run, or `fractus-pod stop` it "
                        "(the pod stays on its stage), then roll back")


def _refuse_going_up(pod_dir: Path, config, to_stage: int, running: bool) -> None:
    """Rollback only goes down: every way up is `launch --stage N`, which runs the canary."""
    state = read_pod_state(pod_dir) if running else None
    current = current_stage(state, read_manifest(pod_dir / config.manifest))
    if current is None:
        raise UserError("the pod has no recorded stage to roll back from (nothing was "
                        "launched yet): use `fractus-pod launch --stage N`")
    if to_stage > current:
        raise UserError(f"--to-stage {to_stage} is above the pod's stage {current}: rollback "
                        f"only goes down; to go up, `fractus-pod launch --stage {to_stage}` "
                        f"(it runs the stage canary first)")


class ProbeFailed(RuntimeError):
    """The probe process ran but gave no result (exit 1: not a mistake in the input)."""


def _existing(pod_dir: Path, given: str, what: str, typed: bool) -> Path:
    """A typed path (relative to the cwd, else the pod), or a pod file's (to the pod)."""
    for path in ((Path(given), pod_dir / given) if typed else (pod_dir / given,)):
        if path.is_file():
            return path.resolve()
    raise UserError(f"{what} not found: {given}")


def read_baselines(pod_dir: Path) -> dict:
    return read_json_state(pod_dir / BASELINES_FILE)


def _probe_files(pod_dir: Path, config, gpu: int | None, checkpoint: str | None,
                 shard: str | None) -> tuple[int | None, int | None, Path, Path, int | None]:
    """(gpu, stage, checkpoint, shard, head) to probe. head: the manifest's start token (a
    v1 file or the merged brain records another, or none); None: the file's own."""
    if checkpoint is not None:
        if gpu is not None:
            raise UserError("give --gpu or --checkpoint, not both")
        if shard is None:
            raise UserError("--checkpoint needs --shard (the tokens to probe on)")
        return (None, None, _existing(pod_dir, checkpoint, "checkpoint", typed=True),
                _existing(pod_dir, shard, "shard", typed=True), None)
    gpu = 0 if gpu is None else gpu
    manifest = read_manifest(pod_dir / config.manifest)
    known = {s.gpu for s in parse_devices(config.devices)} | set(manifest.entries)
    if gpu not in known:
        raise UserError(f"no GPU {gpu} in this pod (GPUs: {sorted(known)})")
    entry = manifest.entries.get(gpu)
    start = resume_point(pod_dir, config, manifest, gpu)   # the manifest's, else the canonical file
    if start.checkpoint is None:
        raise UserError(f"GPU {gpu} has no checkpoint to probe yet")
    ckpt = _existing(pod_dir, start.checkpoint, f"GPU {gpu} checkpoint", typed=False)
    shard_path = (_existing(pod_dir, shard, "shard", typed=True) if shard is not None else
                  _existing(pod_dir, (entry and entry.shard) or
                            config.shard_path(gpu, entry.at_phase if entry else 1),
                            f"GPU {gpu} shard", typed=False))
    head = start.start_token
    if head is None and entry is not None:
        head = entry.start_token
    return gpu, entry.stage if entry else None, ckpt, shard_path, head


def _shard_head(pod_dir: Path, config, shard_path: Path) -> tuple[int, str]:
    """(head, what) without a train head: the head of the GPU training on it, else 0."""
    try:
        manifest = read_manifest(pod_dir / config.manifest)
        gpus = {s.gpu for s in parse_devices(config.devices)} | set(manifest.entries)
    except (ManifestError, UserError):
        return 0, "the start of the shard"
    for gpu in sorted(gpus):
        entry = manifest.entries.get(gpu)
        rel = (entry and entry.shard) or config.shard_path(gpu, entry.at_phase if entry else 1)
        if (pod_dir / rel).resolve() == shard_path and entry and entry.start_token is not None:
            return entry.start_token, f"GPU {gpu}'s manifest head, token {entry.start_token:,}"
    return 0, "the start of the shard (no GPU of the manifest trains on it)"


def _no_baseline_hint(gpu: int | None, stage: int | None) -> str:
    if gpu is not None and stage is not None:
        return (f"no baseline for GPU {gpu} at stage {stage}, so no verdict: record this "
                f"probe as the baseline with `fractus-pod probe --gpu {gpu} --record-baseline`"
                f", or judge against a number with --baseline-ar AR")
    return "no baseline, so no verdict: judge against a number with --baseline-ar AR"


def probe_pod(pod_dir: Path, gpu: int | None = None, checkpoint: str | None = None,
              shard: str | None = None, baseline_ar: float | None = None,
              record_baseline: bool = False, device: str = "cpu",
              timeout_s: float = 900, head: int | None = None) -> dict:
    """Probe GPU `gpu`'s checkpoint (or `checkpoint` on `shard`) and judge it against
    `baseline_ar`, else the launcher's stage_baseline. Returns the probe's numbers, what
    was probed, and the verdict or a hint."""
    config = load_pod_config(pod_dir)
    gpu, stage, ckpt_path, shard_path, gpu_head = _probe_files(pod_dir, config, gpu,
                                                               checkpoint, shard)
    default_head, default_what = (_shard_head(pod_dir, config, shard_path)
                                  if checkpoint is not None else (None, ""))
    if record_baseline and stage is None:
        raise UserError("--record-baseline needs --gpu of a GPU whose stage the manifest records")
    tolerance = load_criteria_file(pod_dir / config.criteria).probe_tolerance
    try:
        result = run_probe_process(ckpt_path, shard_path, head=gpu_head if head is None
                                   else head, device=device, timeout_s=timeout_s, cwd=pod_dir,
                                   model=config.model, default_head=default_head)
    except ProbeUnavailable as exc:
        if exc.bad_input:          # its checkpoint or shard: the user's to fix (exit 2)
            raise UserError(f"cannot probe {ckpt_path.name} on {shard_path.name}: {exc.detail}; "
                            f"give a Fractus checkpoint and a 1-D integer token shard") \
                from None
        raise ProbeFailed(str(exc)) from None
    baselines = read_baselines(pod_dir)
    baseline, source = Baseline.of(baseline_ar), "--baseline-ar"
    if baseline is None and stage is not None:
        # the launcher's own lookup: the recorded baseline, else the one its probes set
        baseline, source = stage_baseline(pod_dir, stage, gpu, shard_path) or (None, None)
    report = {"gpu": gpu, "stage": stage, "checkpoint": str(ckpt_path), "shard": str(shard_path),
              **result, "baseline_ar": baseline.ar if baseline else None,
              "baseline_source": source if baseline else None}
    if head is None and default_head is not None and result.get("next_token") is None:
        report["head_note"] = (f"the checkpoint records no train head: probed from "
                               f"{default_what} (choose another with --head)")
    if baseline is not None:
        report["verdict"], report["reason"] = probe_verdict(result, baseline, tolerance)
    elif not record_baseline:
        report["hint"] = _no_baseline_hint(gpu, stage)
    if record_baseline:
        baselines.setdefault(str(stage), {})[str(gpu)] = {
            "ar": result["ar"], "ar_rows": result.get("ar_rows"), "ar_acc": result.get("ar_acc"),
            "vocab_size": result.get("vocab_size"), "checkpoint": str(ckpt_path),
            "next_token": result.get("next_token"), "ts": time.time()}
        path = pod_dir / BASELINES_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(baselines, indent=2) + "\n")
        report["recorded_baseline"] = True
        spread = Baseline.of(result).spread()
        report["note"] = (f"recorded AR {result['ar']:.4f} as the baseline of GPU {gpu} at "
                          f"stage {stage}" + ("" if spread is None else
                                              f" (window spread {spread:.4f})")
                          + f" in {BASELINES_FILE}: the launcher and later probes of this "
                            f"stage are judged against it")
    return report


@click.command()
@pod_dir_option
@click.option("--to-stage", type=click.IntRange(min=1), required=True,
              help="The stage to go back to (a stage of manifests/stages.yaml below the "
                   "pod's; the next launch runs it).")
@click.option("--gpu", "gpus", type=int, multiple=True,
              help="Restore this GPU's newest passed checkpoint (repeatable). Without it, "
                   "only the stage changes and every GPU keeps its progress.")
@click.pass_context
def rollback(ctx, to_stage: int, gpus: tuple[int, ...]) -> None:
    """The automatic rollback, by hand: restore GPU checkpoints and switch stage."""
    click.echo(manual_rollback(pod_dir_of(ctx), to_stage, list(gpus)))


@click.command()
@pod_dir_option
@click.option("--gpu", type=int, default=None,
              help="Probe this GPU's newest checkpoint on its shard (default: GPU 0).")
@click.option("--checkpoint", default=None, help="Probe this checkpoint file instead.")
@click.option("--shard", default=None, help="Token shard (default: the GPU's).")
@click.option("--head", type=click.IntRange(min=0), default=None,
              help="Shard position the probe windows start at (default: the GPU's manifest "
                   "head; for --checkpoint, the head it records, else the manifest head of "
                   "the GPU training on --shard, else 0).")
@click.option("--baseline-ar", type=float, default=None,
              help="Judge AR against this (default: the baseline recorded for the GPU's stage).")
@click.option("--record-baseline", is_flag=True,
              help="Record this AR as the baseline of the GPU's current stage.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--timeout", type=float, default=900, show_default=True, help="Seconds.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def probe(ctx, gpu, checkpoint, shard, head, baseline_ar, record_baseline, device, timeout,
          as_json) -> None:
    """The trusted-loss AR probe in a child process: AR, ARacc, cold TF (and a verdict)."""
    try:
        report = probe_pod(pod_dir_of(ctx), gpu, checkpoint, shard, baseline_ar, record_baseline,
                           device, timeout, head)
    except ProbeFailed as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps(report))
    else:
        click.echo(f"{report['checkpoint']} on {report['shard']} (positions {report['start']:,}+, "
                   f"{report['rows']} rows): AR={report['ar']:.4f} ARacc={report['ar_acc']:.3f} "
                   f"cold_tf={report['cold_tf']:.4f}")
        if "verdict" in report:
            click.echo(f"{report['verdict']}: {report['reason']} "
                       f"(baseline {report['baseline_source']})")
        for line in (report.get("filled"), report.get("head_note"), report.get("hint"),
                     report.get("note")):
            if line:
                click.echo(line)
    if report.get("verdict") == "Failed":
        sys.exit(1)
