"""`fractus-pod launch` in order, top to bottom in `launch_pod`: the pod lock and early
stop before anything slow (a stop is never lost), a `--from-hub` rebuild, the plan, PREPARE
(any refusal: one line, exit 2, the pod as it was; a rebuilt pod takes the run only after
them all), the canary gate, then the Supervisor (its backend made after the --detach fork).
"""

from __future__ import annotations

import os
import shlex
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import click
import psutil

from launcher.alerts.router import AlertRouter
from launcher.alerts.webhooks import configured_webhooks
from launcher.cli.options import pod_command
from launcher.config.gpus import check_cuda_present
from launcher.config.tracker import check_installed
from launcher.errors import UserError
from launcher.hub import HubError
from launcher.hub.from_hub import Rebuilt, rebuild_from_hub
from launcher.hub.sync import store_for
from launcher.paths import CONFIG_NAME, LAUNCHER_LOG
from launcher.pod.events import EventLog, Mirrors
from launcher.pod.events_tensorboard import EventsToTensorBoard
from launcher.pod.live_state import take_stop_request
from launcher.pod.lock import PodLock
from launcher.pod.manifest import Manifest
from launcher.pod.rounds_ledger import LedgerError, read_ledger
from launcher.supervise.canary_budget import split_budget
from launcher.supervise.custodian import CheckpointCustodian
from launcher.supervise.launch_shards import fetch_shards
from launcher.supervise.plan import LaunchPlan, load_plan
from launcher.supervise.pod_view import ProgressLine
from launcher.supervise.prepare import (complete_decided_rollback, ensure_run_id,
                                        refuse_budget_below_one_push, refuse_if_busy,
                                        refuse_taken_over, validate)
from launcher.supervise.ray.copies import resume_newer_copies
from launcher.supervise.ray.reach import refuse_unreachable
from launcher.supervise.stage_switch import (EarlyStop, LaunchStopped, canary_gate,
                                             stage_before_launch)
from launcher.supervise.supervisor import Supervisor


@dataclass(frozen=True)
class LaunchOptions:
    pod_dir: Path
    stage: int | None
    gpus: str | None
    devices: str | None
    max_time: float | None
    max_steps: int | None
    detach: bool
    from_hub: str | None
    revision: str | None
    trust_hub_config: bool
    no_hub: bool
    no_canary: bool
    ray_address: str | None
    faults: dict[int, str]
    without_hub: str        # this launch as typed again with --no-hub (a refusal's fix)


@dataclass
class Launch:
    """What the steps settle. The plan is never changed in place: a step replaces it."""
    options: LaunchOptions
    plan: LaunchPlan
    manifest: Manifest
    rebuilt: Rebuilt | None
    canary: bool = False            # a switch up: the stage canary runs before any worker
    budget: str | None = None       # how --max-time splits between canary and training
    alerting: tuple | None = None   # the settings and webhooks of `alerts:`
    events: EventLog | None = None
    custodian: CheckpointCustodian | None = None    # the checkpoints' one owner, from here on


def check_faults(launch: Launch) -> None:
    slots = sorted(s.gpu for s in launch.plan.slots)
    for gpu in launch.options.faults:
        if gpu not in slots:
            raise UserError(f"--fault names GPU {gpu}, which this launch does not run; name "
                            f"one of {slots}")


def refuse_budget_below_a_push(launch: Launch) -> None:
    refuse_budget_below_one_push(launch.plan, launch.manifest)


def split_max_time(launch: Launch) -> None:
    """A switch up runs the canary, which --max-time counts: say how it splits (or refuse)."""
    plan = launch.plan
    launch.canary = not launch.options.no_canary and \
        (stage_before_launch(plan, launch.manifest) or plan.stage) < plan.stage
    launch.budget = split_budget(plan, launch.canary)


def refuse_hub_only_without_hub(launch: Launch) -> None:
    """--no-hub on a Ray pod whose checkpoints only the hub holds: refused."""
    if launch.options.no_hub and launch.plan.ckpts_on_hub:
        raise UserError(_hub_only_refusal(launch.plan, launch.manifest,
                                          bool(launch.options.from_hub)))


def reach_the_devices(launch: Launch) -> None:
    plan = launch.plan
    if plan.ray is not None:
        refuse_unreachable(plan.ray)
    else:
        check_cuda_present([s.gpu for s in plan.slots if s.device == "cuda"],
                           launch.options.devices or plan.config.devices)


def check_the_hub(launch: Launch) -> None:
    """A malformed hub: URL refused; no other pod took the run over."""
    plan = launch.plan
    if not plan.config.hub:
        return
    try:
        store_for(plan.config, plan.pod_dir)
    except ValueError as exc:
        raise UserError(f"hub: {exc}") from None
    if launch.rebuilt is None:
        refuse_taken_over(plan, launch.options.without_hub)


def check_alerts_and_tracker(launch: Launch) -> None:
    launch.alerting = configured_webhooks(launch.plan.config)     # a webhook's URL: exit 2
    check_installed(launch.plan.config.tracker_settings())


def check_the_rounds_ledger(launch: Launch) -> None:
    """With merge_rounds: the pod's merge/rounds.json reads as a ledger (or is absent)."""
    if launch.plan.config.merge_round_settings() is None:
        return
    try:
        read_ledger(launch.plan.pod_dir)
    except LedgerError as exc:
        raise UserError(f"{exc}; restore it (e.g. from the hub: fractus-pod sync pull), or "
                        f"move merge/ aside to start the rounds anew") from None


def refuse_busy_gpus(launch: Launch) -> None:
    refuse_if_busy(launch.plan)


def get_the_shards(launch: Launch) -> None:
    fetch_shards(launch.plan, launch.manifest, launch.plan.shards_on_nodes, launch.canary)


def open_the_records(launch: Launch) -> None:
    launch.events = EventLog(launch.plan.pod_dir,
                             mirror=_mirrors(launch.plan.pod_dir, launch.alerting))
    launch.custodian = CheckpointCustodian.for_plan(launch.plan, launch.manifest, launch.events)


def resume_relaunched_copies(launch: Launch) -> None:
    """On Ray: each GPU resumes from the last launcher's newer final save on the hub."""
    plan = launch.plan
    if plan.ray is None:
        return
    relaunched = resume_newer_copies(plan, launch.custodian)
    launch.plan = replace(plan, ckpts_on_hub=plan.ckpts_on_hub | set(relaunched))


def finish_decided_rollback(launch: Launch) -> None:
    launch.plan = complete_decided_rollback(launch.plan, launch.manifest, launch.custodian,
                                            stage_given=launch.options.stage is not None)


def reconcile_the_manifest(launch: Launch) -> None:
    """Adopt late checkpoints, never resume a failed one, recover each entry's bytes."""
    custodian = launch.custodian
    custodian.reconcile(launch.plan.stage)
    custodian.never_resume_failed()
    custodian.recover(launch.plan.ckpts_on_hub)


def validate_the_manifest(launch: Launch) -> None:
    validate(launch.plan, launch.manifest, launch.plan.ckpts_on_hub,
             launch.plan.shards_on_nodes)


def take_the_run(launch: Launch) -> None:
    """The rebuilt pod becomes the run's one writer (none with --no-hub)."""
    rebuilt, plan = launch.rebuilt, launch.plan
    if rebuilt is None:
        return
    with _hub_errors():
        lease = rebuilt.take_run() if plan.config.hub else {}
    weights = ("on the hub: each Ray node pulls its GPU's" if plan.ray is not None
               else "pulled")
    launch.events.emit("rebuilt_from_hub", hub=rebuilt.url, revision=rebuilt.revision,
                       pod_id=lease.get("pod_id"), lease_epoch=lease.get("epoch"),
                       previous_pod=lease.get("previous_pod"), weights=weights)
    writer = (f"this pod ({lease['pod_id']}) now writes the run (lease epoch {lease['epoch']})"
              if lease else "--no-hub: the run stays with the pod that writes it")
    click.echo(f"rebuilt {rebuilt.pod_dir} from {rebuilt.url} at revision "
               f"{rebuilt.revision[:12]}; {writer}")
    launch.rebuilt = None


# Before the canary and the workers, in order (docs/LAUNCHER.md names them in this order).
PREPARE = (
    check_faults,
    refuse_budget_below_a_push,
    split_max_time,
    refuse_hub_only_without_hub,
    reach_the_devices,
    check_the_hub,
    check_alerts_and_tracker,
    check_the_rounds_ledger,
    refuse_busy_gpus,
    get_the_shards,
    open_the_records,
    resume_relaunched_copies,
    finish_decided_rollback,
    reconcile_the_manifest,
    validate_the_manifest,
    take_the_run,
)


def prepare_launch(launch: Launch) -> None:
    for step in PREPARE:
        step(launch)


def launch_pod(options: LaunchOptions, stop: EarlyStop) -> int:
    """The exit code. A refusal before the canary leaves the pod and the hub as they were."""
    pod_dir = options.pod_dir
    # Filled, but not the run's writer until every step that can refuse it has passed.
    rebuilt = _rebuild(options) if options.from_hub else None
    lock = PodLock(pod_dir)
    if (pod_dir / CONFIG_NAME).is_file():    # else load_plan refuses, writing nothing
        lock.acquire()
        if take_stop_request(pod_dir, since=psutil.Process().create_time()):
            stop.signal = "fractus-pod stop received while the launcher started"
    launch = None
    try:
        try:
            # Every file a person writes, read once: nothing below opens them again.
            plan, manifest = load_plan(pod_dir, options.stage, options.devices, options.gpus,
                                       options.max_time, options.max_steps,
                                       options.ray_address, options.no_hub)
            stop.deadline = plan.deadline
            launch = Launch(options, plan, manifest, rebuilt)
            prepare_launch(launch)
        except UserError:
            lock.release(restore=True)     # a refusal leaves the pod as it was
            raise
        return supervise(launch, lock, stop)
    finally:
        if launch is not None:
            rebuilt = launch.rebuilt
            if launch.events is not None:
                launch.events.mirror.close()
        lock.release()
        if rebuilt is not None:     # refused before it took the run over
            rebuilt.undo()


def supervise(launch: Launch, lock: PodLock, stop: EarlyStop) -> int:
    """The canary gate, then the Supervisor until the pod ends; the exit code."""
    plan, manifest, events, options = launch.plan, launch.manifest, launch.events, launch.options
    supervisor = Supervisor(plan, manifest, launch.custodian, events, faults=options.faults,
                            launcher_id=lock.launcher_id)
    started_at = psutil.Process().create_time()      # the ledger's start-up checks
    if launch.budget:
        click.echo(launch.budget)
    try:
        if stop.signal:
            raise LaunchStopped(f"stopped before any worker started ({stop.signal}); "
                                f"nothing switched or started")
        supervisor.gate(lambda: canary_gate(plan, manifest, events, options.no_canary, stop))
    except LaunchStopped as exc:
        events.emit("launch_stopped", stage=stage_before_launch(plan, manifest), reason=str(exc))
        click.echo(f"pod STOPPED: {exc}")
        return 0
    supervisor.pod.custodian.record_baselines(plan.stage, plan.ckpts_on_hub)
    ensure_run_id(manifest)
    if options.detach:
        # Its buffered lines would be written by both processes; the alerts' threads
        # do not survive the fork (what they hold is sent first).
        events.mirror.close()
        _daemonize(plan.pod_dir)
        events.mirror = _mirrors(plan.pod_dir, launch.alerting)
        lock.record_holder()
    supervisor.open_backend()       # after the fork: a Ray driver does not survive one
    stage = plan.stages[plan.stage]
    click.echo(f"pod {plan.pod_dir}: stage {plan.stage} ({stage.name}), "
               f"{len(plan.slots)} worker(s) on {plan.slots[0].device}"
               + (f", for {plan.max_time:g}s" if plan.max_time else "")
               + f"; `{pod_command(plan.pod_dir, 'status')}` to watch, "
                 f"`{pod_command(plan.pod_dir, 'stop')}` to stop")
    code = supervisor.run(started_at, stop.signal,     # a stop that came before supervision
                          None if options.detach else ProgressLine(supervisor.pod))
    ended = supervisor.pod
    click.echo(f"pod {ended.state.upper()} at stage {ended.stage}"
               + (f": {ended.reason}" if ended.reason else ""))
    taken_over = ended.custodian.taken_over
    if taken_over:           # the last thing said: this pod's progress is not on the hub
        click.echo(f"hub {plan.config.hub} NOT updated: {taken_over}; this pod's newest "
                   f"checkpoints are only in {plan.pod_dir}")
    return code


def _mirrors(pod_dir: Path, alerting) -> Mirrors:
    return Mirrors(EventsToTensorBoard(pod_dir),
                   AlertRouter(pod_dir, *alerting) if alerting is not None else None)


def _rebuild(options: LaunchOptions) -> Rebuilt:
    """The empty pod filled from one hub revision (Ray: no weights); not yet the writer."""
    with _hub_errors():
        return rebuild_from_hub(options.pod_dir, options.from_hub, options.revision,
                                options.ray_address is not None, options.trust_hub_config,
                                options.ray_address)


@contextmanager
def _hub_errors():
    """A hub's refusal in one line: a missing repo or revision (404) is the user's to fix."""
    try:
        yield
    except HubError as exc:
        if exc.status == 404:
            raise UserError(f"--from-hub: {exc}") from None
        raise click.ClickException(f"--from-hub: {exc}") from None
    except ValueError as exc:
        raise UserError(f"--from-hub: {exc}") from None


def _hub_only_refusal(plan: LaunchPlan, manifest: Manifest, rebuilt: bool) -> str:
    """The refusal with its fix: keep the hub, or pull the checkpoints here first."""
    on_hub = sorted(plan.ckpts_on_hub)
    gpus = ", ".join(map(str, on_hub))
    if rebuilt:
        return (f"--no-hub: GPU(s) {gpus} resume from a checkpoint only the hub holds, which "
                f"Ray nodes fetch from it: launch --from-hub without --no-hub (the rebuilt pod "
                f"then writes the run), or onto this machine's devices, not a Ray cluster "
                f"(the rebuild then pulls the weights here)")
    by_revision: dict[str, list[str]] = {}
    for gpu in on_hub:
        entry = manifest.entries[gpu]
        by_revision.setdefault(entry.hub_revision, []).append(entry.checkpoint)
    pulls = " && ".join(pod_command(plan.pod_dir, shlex.join(["sync", "pull", "--revision",
                                                              rev, *paths]))
                        for rev, paths in by_revision.items())
    return (f"--no-hub: GPU(s) {gpus} resume from a checkpoint only the hub holds, which "
            f"their Ray nodes fetch from it: launch without --no-hub, or (nodes on this "
            f"machine or a shared filesystem) pull it here first: {pulls}")


def _daemonize(pod_dir: Path) -> None:
    """Double fork; the parent prints the launcher's pid and exits 0."""
    read_fd, write_fd = os.pipe()
    if os.fork() > 0:
        os.close(write_fd)
        pid = os.read(read_fd, 32).decode().strip()
        click.echo(f"launcher running in the background (pid {pid}); "
                   f"`{pod_command(pod_dir, 'status')}`, `{pod_command(pod_dir, 'stop')}`; "
                   f"log: {pod_dir / LAUNCHER_LOG}")
        os._exit(0)
    os.close(read_fd)
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    os.write(write_fd, str(os.getpid()).encode())
    os.close(write_fd)
    log = os.open(pod_dir / LAUNCHER_LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
