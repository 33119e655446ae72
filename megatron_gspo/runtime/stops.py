"""Deadlines that leave out the time the trainer spent stopped.

A job is stopped whole (SIGSTOP, Slurm's ``scontrol suspend``, gang scheduling, a paused VM):
the trainer, its workers and its event loops stop together, while the servers it was waiting
for go on answering. The monotonic clock runs on through the stop, so a deadline counted on it
alone expires the moment the job resumes and fails calls that were frozen half-way, or whose
answer is already waiting in a socket. A stop cannot be observed directly; it shows as a wait
that ends much later than it was bounded to. Waits bounded to :data:`TICK_S` therefore see
every stop, and :func:`stopped_for` tells such a stop from a busy interpreter's delay.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Awaitable
from typing import TypeVar

__all__ = ["STOPPED_S", "TICK_S", "stopped_for", "wait_process", "within"]

T = TypeVar("T")

# A wait that must notice a stop is bounded to this: a deadline then loses at most this much
# of its time to a stop, however much of it was left when the stop began.
TICK_S = 1.0
# A wait ending this much past its bound was stopped, not delayed: a busy interpreter delays a
# thread by milliseconds. A shorter stop goes unseen and costs a deadline at most this much.
STOPPED_S = 2.0


def stopped_for(elapsed: float, bound: float) -> float:
    """Of ``elapsed`` seconds spent in a wait bounded to ``bound``, those the process spent
    stopped: all that it overran the bound by, or nothing if that is within a delay's."""
    late = elapsed - bound
    return late if late > STOPPED_S else 0.0


async def within(awaitable: Awaitable[T], timeout_s: float) -> T:
    """``asyncio.wait_for(awaitable, timeout_s)``, its ``timeout_s`` counted in the time the
    process ran: a stop does not spend it. Raises :class:`TimeoutError` when it is spent, with
    ``awaitable`` cancelled, as ``wait_for`` does."""
    task = asyncio.ensure_future(awaitable)
    left = timeout_s
    try:
        while True:
            bound = min(TICK_S, left)
            start = time.monotonic()
            done, _ = await asyncio.wait({task}, timeout=bound)
            if done:
                return task.result()
            elapsed = time.monotonic() - start
            left -= elapsed - stopped_for(elapsed, bound)
            if left <= 0:
                raise TimeoutError
    finally:
        if not task.done():
            task.cancel()
            await asyncio.wait({task})


def wait_process(proc: subprocess.Popen, timeout_s: float) -> int:
    """``proc.wait(timeout_s)``, its ``timeout_s`` counted in the time this process ran: a
    child stopped with it is not timed out for the stop. Raises
    :class:`subprocess.TimeoutExpired` when it is spent, as ``wait`` does."""
    left = timeout_s
    while True:
        bound = min(TICK_S, left)
        start = time.monotonic()
        try:
            return proc.wait(timeout=bound)
        except subprocess.TimeoutExpired:
            elapsed = time.monotonic() - start
            left -= elapsed - stopped_for(elapsed, bound)
            if left <= 0:
                raise subprocess.TimeoutExpired(proc.args, timeout_s) from None
