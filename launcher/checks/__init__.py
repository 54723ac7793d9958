"""judging a run: health checks, criteria, canary, AR probe."""
