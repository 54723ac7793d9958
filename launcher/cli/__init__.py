"""`fractus-pod` commands (the CLI; imports the packages below)."""

from launcher.cli.main import cli, main

__all__ = ["cli", "main"]
