"""Supervision as an explicit state machine over a worker backend.

- `state`: the states of a GPU and of the pod, the events that move them, and the one
  transition table (in the spirit of TorchElastic's agent: run -> monitor -> restart).
- `backend`: `WorkerBackend`, what the supervisor asks of whatever runs its workers (start a
  worker with its env on a device, poll its exit and liveness, signal, kill, where its
  files are).
- `local_backend`: `LocalBackend`, the workers as child processes of the launcher (launcher/child.py).
- `ray_backend`: `RayBackend`, the workers as Ray actors across the nodes of a Ray cluster.

The supervisor (launcher/supervise/supervisor.py) runs the loop and composes the policy, one
component per job over a shared PodRun (pod_run.py): monitor.py (a worker's lines into health,
checkpoint index, manifest), exits.py (one handler per exit event), restart.py (crash,
backoff, give up; hang), starter.py, placement.py (node loss), rollback.py, ending.py (stop,
failure, full disk), final_verdicts.py, pod_view.py (logs/pod_state.json for `status`).
"""
