"""A private network namespace for the calling (single-threaded, freshly forked) process: the
only protection ``sandbox: unsafe_local`` keeps of the python tool's (:mod:`.bwrap`)."""

from __future__ import annotations

import ctypes
import os

__all__ = ["unshare_network"]

_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000


def unshare_network() -> str | None:
    """None once this process has a network namespace of its own with loopback alone; else
    why not (as root ``CLONE_NEWNET``, otherwise within a new user namespace)."""
    libc = ctypes.CDLL(None, use_errno=True)
    for flags in (_CLONE_NEWNET, _CLONE_NEWUSER | _CLONE_NEWNET):
        if libc.unshare(flags) == 0:
            return None
    return os.strerror(ctypes.get_errno())
