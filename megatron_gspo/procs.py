"""Helper processes that end with the process that started them.

A trainer killed with SIGKILL cannot clean up, so every helper it starts (reward workers, the
generation worker, Megatron's checkpoint-writer queue) asks the kernel to kill it when its
parent dies (Linux ``PR_SET_PDEATHSIG``); elsewhere this does nothing.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

__all__ = ["die_with_parent"]

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> None:
    """Call in a child process started by ``parent_pid``: the kernel sends it ``sig`` when its
    parent exits."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
    # The parent may have died before the call: then nobody would send the signal.
    if os.getppid() != parent_pid:
        os._exit(1)
