"""One worker process: its environment (the worker contract, docs/WORKER.md), how it is
started, and its metrics file read as it grows."""
