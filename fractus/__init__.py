"""Fractus engine: checkpoint-compatible with the reference, with proven-equal fast kernels."""

__version__ = "0.1.0"
