"""The one exception the checkpoint readers and the writer raise for bad input."""

from __future__ import annotations

__all__ = ["CheckpointError"]


class CheckpointError(ValueError):
    """A checkpoint (or the request to write one) is wrong: a message names the file or tensor,
    what was expected and what was found. Raised before anything is half-loaded or half-written."""
