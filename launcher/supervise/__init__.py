"""Supervision as an explicit state machine over a worker backend.

- `state`: the states of a GPU and of the pod, the events that move them, and the one
  transition table (in the spirit of TorchElastic's agent: run -> monitor -> restart).
- `backend`: `WorkerBackend`, what the supervisor asks of whatever runs its workers,
  processes only (start a worker with its env on a device, poll its exit and liveness,
  signal, kill, stop, close, where its files are).
- `local_backend`: `LocalBackend`, the workers as child processes of the launcher (launcher/child.py).
- `ray/`: `RayBackend`, the workers as Ray actors across the nodes of a Ray cluster, and
  `RayCustodian`, the checkpoints on those nodes.
- `custodian`: `CheckpointCustodian`, the one owner of a checkpoint from its event to its
  last copy (index, verdicts, pushes, restore, rollback target, the run's hub lease), with
  where the copies are: `LocalCopies` (this machine), `NodeCopies` (the workers' nodes).

The supervisor (launcher/supervise/supervisor.py) runs the loop and composes the policy, one
component per job over a shared PodRun (pod_run.py): monitor.py (a worker's lines into health,
the custodian, the manifest), exits.py (one handler per exit event), restart.py (crash,
backoff, give up; hang), starter.py, placement.py (node loss), rollback.py, ending.py (stop,
failure, full disk), final_verdicts.py, pod_view.py (logs/pod_state.json for `status`).
"""
