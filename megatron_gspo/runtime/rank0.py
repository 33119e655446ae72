"""Work that global rank 0 alone does (the file system, the environment, the reward functions)
and every rank needs the outcome of."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

__all__ = ["on_rank0"]

T = TypeVar("T")


def on_rank0(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on global rank 0, its result (or its error, raised) on every rank.

    Collective. The error travels too, so the other ranks raise it instead of waiting in the
    broadcast for a result that never comes."""
    out: list = [None]
    if dist.get_rank() == 0:
        try:
            out[0] = ("ok", fn(*args))
        except Exception as e:  # noqa: BLE001 - raised on every rank below
            out[0] = ("error", e)
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(out, src=0)
    kind, value = out[0]
    if kind == "error":
        raise value
    return value
