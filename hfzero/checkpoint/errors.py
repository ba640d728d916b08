"""The one error type of the checkpoint package."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, read or applied; the message names the file and the problem."""
