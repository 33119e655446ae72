"""Trainer side: a server's weights version as ``/weight_info`` labels it and as the trainer
compares it."""

from __future__ import annotations

__all__ = ["PARTIAL", "STARTED_WITH", "parse_version"]

# The version label of a server from the moment an update starts until it completes: a
# half-updated server is never mistaken for the version before or after.
PARTIAL = "partial"
# vLLM's label before any update: the checkpoint the server started with.
STARTED_WITH = "default"


def parse_version(label: str | None) -> int | str | None:
    """A server's ``/weight_info`` label as the engine compares it: the trainer's version
    (int), None for the checkpoint it started with, or the label itself (``partial``)."""
    if label is None or label == STARTED_WITH:
        return None
    return int(label) if label.isdigit() else label
