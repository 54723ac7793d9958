"""Errors the CLI turns into one clear line and an exit code (no traceback)."""


class UserError(Exception):
    """A mistake in the user's files, settings or command line: exit code 2, nothing started."""

    exit_code = 2


class PodBusy(UserError):
    """Another launcher holds the pod, or a worker already runs on a requested GPU."""
