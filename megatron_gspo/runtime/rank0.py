"""Work that global rank 0 alone does (the file system, the environment, the reward functions)
and every rank needs the outcome of."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

__all__ = ["on_rank0"]

T = TypeVar("T")


def on_rank0(fn: Callable[..., T], *args: Any, share: bool = True) -> T:
    """``fn(*args)`` on global rank 0, its result (or its error, raised) on every rank.

    Collective. The error travels too, so the other ranks raise it instead of waiting in the
    broadcast for a result that never comes: any error, ``BaseException`` included (a worker
    thread's ``SystemExit`` or ``KeyboardInterrupt`` stored and raised on the main thread).
    ``share=False``: the result stays on rank 0 (the other ranks get None), for what only
    rank 0 keeps (a checkpoint's rollout queue); its error still reaches every rank."""
    if not dist.is_initialized():  # one process, no ranks: it is rank 0
        return fn(*args)
    out: list = [None]
    rank0 = dist.get_rank() == 0
    kept = None
    if rank0:
        try:
            kept = fn(*args)
            out[0] = ("ok", kept if share else None)
        except BaseException as e:  # noqa: BLE001 - raised on every rank below
            out[0] = ("error", e)
    if dist.get_world_size() > 1:
        if out[0] is not None and out[0][0] == "error" and not _travels(out[0][1]):
            error = out[0][1]
            # Rank 0 raises its own; the others get its type's name and message.
            out[0] = ("error", RuntimeError(f"{type(error).__name__}: {error}"))
            dist.broadcast_object_list(out, src=0)
            raise error
        dist.broadcast_object_list(out, src=0)
    kind, value = out[0]
    if kind == "error":
        raise value
    return kept if rank0 and not share else value


def _travels(error: BaseException) -> bool:
    """Whether the error survives pickling (an exception whose constructor takes other
    arguments than its message does not)."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:  # noqa: BLE001 - any failure means it cannot be sent as it is
        return False
    return True
