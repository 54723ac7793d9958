"""`fractus-pod launch`: validate everything, then start one worker per GPU and supervise
them (launcher/supervise/), on this machine or on a Ray cluster; `--from-hub` first rebuilds
an empty pod directory from the hub, `--detach` supervises in the background. Registered on
the `fractus-pod` group by launcher/cli/main.py."""

from __future__ import annotations

import dataclasses
import os
import shlex
import sys
from contextlib import contextmanager
from pathlib import Path

import click
import psutil

from launcher.cli.options import (check_trust_flag, pod_command, pod_dir_of, pod_dir_option,
                                  trust_hub_config_option)
from launcher.errors import UserError, install_hint
from launcher.paths import CONFIG_NAME, LAUNCHER_LOG
from launcher.pod.live_state import take_stop_request
from launcher.pod.events import EventLog
from launcher.pod.lock import PodLock
from launcher.pod.events import Mirrors


def _parse_faults(values: tuple[str, ...]) -> dict[int, str]:
    faults = {}
    for value in values:
        gpu, sep, spec = value.partition(":")
        if not sep or not gpu.isdigit() or not spec:
            raise UserError(f"--fault expects GPU:KIND@STEP (e.g. 1:nan@30), got {value!r}")
        faults[int(gpu)] = spec
    return faults


@click.command()
@pod_dir_option
@click.option("--stage", type=int, default=None,
              help="Stage of manifests/stages.yaml to run (default: the manifest's).")
@click.option("--gpus", default=None, help="Subset of GPUs, e.g. 0,1,2 or 0-3.")
@click.option("--devices", default=None,
              help="cpu:N, cuda, cuda:0-7 or auto (default: the pod config's).")
@click.option("--max-time", type=float, default=None,
              help="Stop gracefully (every worker checkpoints) after this many seconds.")
@click.option("--max-steps", type=click.IntRange(min=1), default=None,
              help="Each worker stops after this many steps (per worker start).")
@click.option("--detach", is_flag=True, help="Supervise in the background (logs/launcher.log).")
@click.option("--from-hub", "from_hub", default=None, metavar="URL",
              help="Rebuild this EMPTY pod directory from a hub (hf://owner/repo or "
                   "file://DIR): config, manifest, checkpoints; then launch.")
@click.option("--revision", default=None,
              help="With --from-hub: the hub revision to rebuild from (default: the newest).")
@trust_hub_config_option("--from-hub")
@click.option("--no-hub", is_flag=True,
              help="Train without the pod config's hub: no push, no pull (e.g. when another "
                   "pod took the run over). With --from-hub: rebuild without taking the run "
                   "over.")
@click.option("--no-canary", is_flag=True,
              help="Switch to a higher --stage without the canary (recorded in the events).")
@click.option("--ray", "ray_address", default=None, metavar="ADDRESS",
              help="Run the workers on the Ray cluster at ADDRESS (host:port), one actor per "
                   "GPU across its nodes (default: the pod config's ray: address, else "
                   "child processes on this machine).")
@click.option("--fault", "faults", multiple=True, hidden=True,
              help="Tests only: GPU:KIND@STEP fault injection on that worker's first start.")
@click.pass_context
def launch(ctx, stage, gpus, devices, max_time, max_steps, detach, from_hub, revision,
           trust_hub_config, no_hub, no_canary, ray_address, faults) -> None:
    """Validate everything, then start one worker per GPU and supervise them."""
    # A stop is never lost (issue 16, item 23): SIGTERM/SIGINT are remembered from the first
    # line (the imports below take seconds on a loaded machine), and the pod lock, which
    # `fractus-pod stop` looks for, is taken before anything slow. A `stop` that came
    # before the lock left a stop request, taken with it.
    from launcher.supervise.stage_switch import EarlyStop, LaunchStopped, canary_gate, stage_before_launch
    stop = EarlyStop(None)
    stop.install()
    from launcher.pod.ckpt_index import CheckpointIndex
    from launcher.supervise.launch_shards import fetch_shards, shards_on_nodes
    from launcher.supervise.plan import load_plan
    from launcher.supervise.prepare import (
        complete_decided_rollback,
        ensure_run_id,
        never_resume_failed,
        on_the_hub,
        reconcile,
        record_baselines,
        recover_checkpoints,
        refuse_budget_below_one_push,
        refuse_if_busy,
        refuse_taken_over,
        validate,
    )
    from launcher.supervise.pod_view import ProgressLine
    from launcher.supervise.supervisor import Supervisor
    pod_dir = pod_dir_of(ctx)
    if revision and not from_hub:
        raise UserError("--revision goes with --from-hub (a resumed pod uses the revisions "
                        "its manifest records)")
    check_trust_flag(trust_hub_config, from_hub, "--from-hub",
                     "a pod's own fractus-pod.yaml is always taken as it is")
    # Filled, but not the run's writer until everything below that can refuse has passed;
    # until then a refusal empties the directory again and leaves the hub untouched.
    rebuilt = _rebuild(pod_dir, from_hub, revision, ray_address, trust_hub_config) \
        if from_hub else None
    lock = PodLock(pod_dir)
    if (pod_dir / CONFIG_NAME).is_file():    # else load_plan refuses, writing nothing
        lock.acquire()
        if take_stop_request(pod_dir, since=psutil.Process().create_time()):
            stop.signal = "fractus-pod stop received while the launcher started"
    events = None
    try:
        try:
            # Every file a person writes, read once: nothing below opens them again.
            plan, manifest = load_plan(pod_dir, stage, devices, gpus, max_time, max_steps,
                                       _parse_faults(faults), ray_address)
            if no_hub:      # this launch only: fractus-pod.yaml keeps its hub:
                plan = dataclasses.replace(
                    plan, config=dataclasses.replace(plan.config, hub=None))
            refuse_budget_below_one_push(plan, manifest)
            stop.deadline = plan.deadline
            from launcher.supervise.canary_budget import split_budget
            canary = not no_canary and \
                (stage_before_launch(plan, manifest) or plan.stage) < plan.stage
            budget = split_budget(plan, canary)
            ray_settings = plan.ray
            on_hub = on_the_hub(plan, manifest) if ray_settings is not None else set()
            if no_hub and on_hub:           # before the cluster is reached
                raise UserError(_hub_only_refusal(pod_dir, manifest, on_hub, bool(from_hub)))
            if ray_settings is not None:    # before anything is written: a refusal writes nothing
                from launcher.supervise.ray_reach import refuse_unreachable
                refuse_unreachable(ray_settings)
            if ray_settings is None:        # on Ray the nodes hold the GPUs, not this machine
                from launcher.config.gpus import check_cuda_present
                check_cuda_present([s.gpu for s in plan.slots if s.device == "cuda"],
                                   devices or plan.config.devices)
            on_nodes = shards_on_nodes(plan, ray_settings is not None)
            if plan.config.hub:
                from launcher.hub.sync import store_for
                try:
                    store_for(plan.config, pod_dir)    # a malformed hub: URL is refused
                except ValueError as exc:
                    raise UserError(f"hub: {exc}") from None
                if rebuilt is None:     # a rebuilt pod takes the run over below
                    refuse_taken_over(plan, _retyped(ctx, pod_dir, "--no-hub"))
            from launcher.alerts.webhooks import configured_webhooks
            alerting = configured_webhooks(plan.config)     # a webhook's URL: exit 2
            from launcher.config.tracker import check_installed
            check_installed(plan.config.tracker_settings())
            refuse_if_busy(plan)
            fetch_shards(plan, manifest, on_nodes, canary)
            events = EventLog(pod_dir, mirror=_mirrors(pod_dir, alerting))
            index = CheckpointIndex(pod_dir)
            relaunched = {}      # the last launcher's final saves, on the hub (Ray)
            if ray_settings is not None:
                from launcher.supervise.ray_custodian import resume_newer_copies
                relaunched = resume_newer_copies(plan, manifest, index, events)
                on_hub |= set(relaunched)
            plan = complete_decided_rollback(plan, manifest, index, events,
                                             stage_given=stage is not None)
            reconcile(plan, manifest, index, events)
            never_resume_failed(plan, manifest, index, events)
            recover_checkpoints(plan, manifest, index, events, on_hub)
            validate(plan, manifest, on_hub, on_nodes)
            if rebuilt is not None:     # everything that can refuse it passed
                _take_run(rebuilt, plan, events)
                rebuilt = None
        except UserError:
            lock.release(restore=True)     # a refusal leaves the pod as it was
            raise
        supervisor = Supervisor(plan, manifest, index, events)
        supervisor.pod.launcher_id = lock.launcher_id
        supervisor.pod.launch_entries.update(relaunched)   # a rollback's target: never a copy
        supervisor.started_at = psutil.Process().create_time()  # the ledger's start-up checks
        if budget:
            click.echo(budget)
        try:
            if stop.signal:
                raise LaunchStopped(f"stopped before any worker started ({stop.signal}); "
                                    f"nothing switched or started")
            supervisor.gate(lambda: canary_gate(plan, manifest, events, no_canary, stop))
        except LaunchStopped as exc:
            events.emit("launch_stopped", stage=stage_before_launch(plan, manifest), reason=str(exc))
            click.echo(f"pod STOPPED: {exc}")
            sys.exit(0)
        record_baselines(plan, manifest, index, on_hub)
        ensure_run_id(manifest)
        if detach:
            # Its buffered lines would be written by both processes; the alerts' threads
            # do not survive the fork (what they hold is sent first).
            events.mirror.close()
            _daemonize(pod_dir)
            events.mirror = _mirrors(pod_dir, alerting)
            lock.record_holder()
        if ray_settings is not None:       # after the fork: a Ray driver does not survive one
            supervisor.use_backend(*_ray_backend(pod_dir, plan, ray_settings, events))
        stage = plan.stages[plan.stage]
        click.echo(f"pod {pod_dir}: stage {plan.stage} ({stage.name}), "
                   f"{len(plan.slots)} worker(s) on {plan.slots[0].device}"
                   + (f", for {plan.max_time:g}s" if plan.max_time else "")
                   + f"; `{pod_command(pod_dir, 'status')}` to watch, "
                     f"`{pod_command(pod_dir, 'stop')}` to stop")
        supervisor.stop_reason = stop.signal       # a stop that came before supervision
        if not detach:       # in the foreground, a line of each GPU's numbers now and then
            supervisor.progress = ProgressLine(supervisor.pod)
        code = supervisor.run()
        ended = supervisor.pod
        click.echo(f"pod {ended.state.upper()} at stage {ended.stage}"
                   + (f": {ended.reason}" if ended.reason else ""))
        taken_over = supervisor.sync.taken_over if supervisor.sync is not None else None
        if taken_over:           # the last thing said: this pod's progress is not on the hub
            click.echo(f"hub {plan.config.hub} NOT updated: {taken_over}; this pod's newest "
                       f"checkpoints are only in {pod_dir}")
    finally:
        if events is not None:
            events.mirror.close()
        lock.release()
        if rebuilt is not None:     # refused before it took the run over
            rebuilt.undo()
    sys.exit(code)


def _mirrors(pod_dir: Path, alerting):
    """What EventLog feeds each event to: the TensorBoard run, and the alerts if any
    (`alerting`: the settings and webhooks of launcher/alerts/webhooks.configured_webhooks)."""
    # imported when run, not at startup: `fractus-pod --help` loads every command module
    from launcher.pod.events_tensorboard import EventsToTensorBoard
    router = None
    if alerting is not None:
        from launcher.alerts.router import AlertRouter
        router = AlertRouter(pod_dir, *alerting)
    return Mirrors(EventsToTensorBoard(pod_dir), router)


def _ray_backend(pod_dir: Path, plan, settings, events):
    """The Ray pod's workers (RayBackend) and its checkpoints on the nodes (RayCustodian)."""
    try:
        # imported when run, not at startup: `fractus-pod --help` loads every command module
        from launcher.supervise.ray_backend import RayBackend
        from launcher.supervise.ray_custodian import RayCustodian
    except ImportError:
        raise UserError(f"--ray needs Ray: {install_hint('ray')}") from None
    try:
        backend = RayBackend(pod_dir, plan.config, settings, events, len(plan.slots))
        return backend, RayCustodian(backend)
    except ConnectionError as exc:
        from launcher.supervise.ray_reach import unreachable
        raise UserError(unreachable(settings.address, exc)) from None


def _rebuild(pod_dir: Path, url: str, revision: str | None, ray_address: str | None,
             trust_config: bool):
    """launch --from-hub: fill the empty pod directory from one pinned hub revision (for a
    Ray cluster, `--ray ray_address`, without the weights: each node pulls its GPU's).
    Returns launcher/hub/from_hub.Rebuilt: not yet the run's writer."""
    # imported when run, not at startup: `fractus-pod --help` loads every command module
    from launcher.hub.from_hub import rebuild_from_hub
    with _hub_errors():
        return rebuild_from_hub(pod_dir, url, revision, ray_address is not None,
                                trust_config, ray_address)


def _take_run(rebuilt, plan, events: EventLog) -> None:
    """The rebuilt pod becomes the run's one writer (none with --no-hub: the plan has no
    hub), said in one line and a `rebuilt_from_hub` event."""
    with _hub_errors():
        lease = rebuilt.take_run() if plan.config.hub else {}
    weights = ("on the hub: each Ray node pulls its GPU's" if plan.ray is not None
               else "pulled")
    events.emit("rebuilt_from_hub", hub=rebuilt.url, revision=rebuilt.revision,
                pod_id=lease.get("pod_id"), lease_epoch=lease.get("epoch"),
                previous_pod=lease.get("previous_pod"), weights=weights)
    writer = (f"this pod ({lease['pod_id']}) now writes the run (lease epoch {lease['epoch']})"
              if lease else "--no-hub: the run stays with the pod that writes it")
    click.echo(f"rebuilt {rebuilt.pod_dir} from {rebuilt.url} at revision "
               f"{rebuilt.revision[:12]}; {writer}")


@contextmanager
def _hub_errors():
    """A hub's refusal in one line: a missing repo or revision (404) is the user's to fix."""
    from launcher.hub import HubError   # when run: `fractus-pod --help` loads this module
    try:
        yield
    except HubError as exc:
        if exc.status == 404:
            raise UserError(f"--from-hub: {exc}") from None
        raise click.ClickException(f"--from-hub: {exc}") from None
    except ValueError as exc:
        raise UserError(f"--from-hub: {exc}") from None


def _hub_only_refusal(pod_dir: Path, manifest, on_hub: set[int], rebuilt: bool) -> str:
    """--no-hub on a Ray pod whose checkpoints only the hub holds: its nodes would have
    nowhere to fetch them from. The fix: keep the hub, or pull them here first (one command
    per revision), which nodes on this machine or a shared filesystem read from the pod; a
    rebuild (`rebuilt`, undone by the refusal) pulls them itself when it is not for Ray."""
    gpus = ", ".join(map(str, sorted(on_hub)))
    if rebuilt:
        return (f"--no-hub: GPU(s) {gpus} resume from a checkpoint only the hub holds, which "
                f"Ray nodes fetch from it: launch --from-hub without --no-hub (the rebuilt pod "
                f"then writes the run), or onto this machine's devices, not a Ray cluster "
                f"(the rebuild then pulls the weights here)")
    by_revision: dict[str, list[str]] = {}
    for gpu in sorted(on_hub):
        entry = manifest.entries[gpu]
        by_revision.setdefault(entry.hub_revision, []).append(entry.checkpoint)
    pulls = " && ".join(pod_command(pod_dir, shlex.join(["sync", "pull", "--revision", rev,
                                                         *paths]))
                        for rev, paths in by_revision.items())
    return (f"--no-hub: GPU(s) {gpus} resume from a checkpoint only the hub holds, which "
            f"their Ray nodes fetch from it: launch without --no-hub, or (nodes on this "
            f"machine or a shared filesystem) pull it here first: {pulls}")


def _retyped(ctx: click.Context, pod_dir: Path, *extra: str) -> str:
    """This launch's command line as it can be typed again, with `extra` options."""
    words = ["fractus-pod", "--pod-dir", str(pod_dir), "launch", *extra]
    for param in ctx.command.params:
        value = ctx.params.get(param.name)
        if not isinstance(param, click.Option) or value in (None, False, ()):
            continue        # (--pod-dir is not a value of the command: named above)
        for one in (value if param.multiple else (value,)):
            words += [param.opts[0]] if param.is_flag else [param.opts[0], str(one)]
    return shlex.join(words)


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
