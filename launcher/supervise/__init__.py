"""Supervision as an explicit state machine over a worker backend.

- `state`: the states of a GPU and of the pod, the events that move them, and the one
  transition table (in the spirit of TorchElastic's agent: run -> monitor -> restart).
- `backend`: `WorkerBackend`, what the supervisor asks of whatever runs its workers (start a
  worker with its env on a device, poll its exit and liveness, signal, kill, where its
  files are).
- `local`: `LocalBackend`, the workers as child processes of the launcher (launcher/child.py).
- `ray_backend`: `RayBackend`, the workers as Ray actors across the nodes of a Ray cluster.

The supervisor (launcher/supervise/supervisor.py) holds the policy: which event a worker's exit is,
when a crash becomes a failure, rollback, stop.
"""
