"""Supervision as an explicit state machine over a worker backend: supervisor.py runs the loop
over components sharing one PodRun, state.py holds the one transition table, a
`WorkerBackend` (backend.py; local_backend.py, ray/) runs the processes only, and the
`CheckpointCustodian` (custodian.py) owns every checkpoint. The map of modules and
components: docs/LAUNCHER.md "How the supervisor decides"."""
